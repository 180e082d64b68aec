"""The benchmark scripts: their tables and target checks on canned numbers, and one ``--quick`` smoke run each.

Timings on a shared CPU are noisy, so PASS is never required of a timing target; the bytes
ratio against DDP is deterministic, so the smoke run checks it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from experiments.common import compose_job
from experiments.fault_tolerance import bench_restart
from experiments.parallelism import bench_overhead, bench_sync
from experiments.scale import bench_model_size, checkpoint_io, cost_lines
from tests.experiments.in_process import run_main

TIMEOUT_S = 240


def run_script(name: str, results: Path, capsys, *args: str) -> str:
    out, _ = run_main(name, ["--quick", "--results", str(results), *args], TIMEOUT_S, capsys)
    return out


@pytest.mark.parametrize("experiment", ["bench_sync", "bench_overhead"])
def test_experiment_configs_compose(experiment):
    job = compose_job([], experiment)
    assert job.model.n_layers >= 4 and job.trainer.log_every == 1


def test_bench_sync_report_gives_the_ratio_and_the_two_group_target():
    rows = [bench_sync.Row(2, 2_100_000, 8, 30.0, 20.0, 4.25), bench_sync.Row(3, 2_100_000, 12, 50.0, 20.0, 5.0)]
    lines = bench_sync.report(rows, 10, 40).splitlines()
    assert lines[0].startswith("DiLoCo outer sync vs inner step: 2.10M fp32 parameters, H=10,")
    assert "(syncs timed: 2 groups 8, 3 groups 12)" in lines[0]
    assert lines[2] == "| " + " | ".join(bench_sync.HEADERS) + " |"
    assert lines[4:6] == ["| 2 | 30.0 | 20.0 | 1.50 | 4.2 |", "| 3 | 50.0 | 20.0 | 2.50 | 5.0 |"]
    assert lines[-1] == "2-group sync of ~2M fp32 params costs <= 2 inner steps: PASS (ratio 1.50)"
    assert bench_sync.report(rows[1:], 10, 40).splitlines()[-1].startswith("| 3 |"), "no 2-group row: no target"


def _overhead_run(loop_s: float, syncs: int = 0, bytes_per_token: float = 0.0) -> bench_overhead.Run:
    return bench_overhead.Run(loop_s, loop_s + 5, syncs, int(bytes_per_token * 1000), bytes_per_token, 800_000, 1.0)


def test_bench_overhead_report_takes_overhead_per_repeat_and_bytes_against_ddp():
    runs = {
        bench_overhead.LOCAL: [_overhead_run(10.0), _overhead_run(20.0)],
        bench_overhead.DILOCO: [_overhead_run(11.0, 4, 2.0), _overhead_run(21.0, 4, 2.0)],
        bench_overhead.STREAMING: [_overhead_run(10.1, 8, 0.5), _overhead_run(20.4, 8, 0.5)],
    }
    lines = bench_overhead.report("setup", runs, _overhead_run(5.0, 10, 250.0)).splitlines()
    diloco = next(line for line in lines if line.startswith(f"| {bench_overhead.DILOCO} | 4 |"))
    assert "| +7.5 (+10.0, +5.0) |" in diloco, "median of the per-repeat overheads against that repeat's local run"
    assert "| ddp (every step) | 250,000 | 250.0 | 1 |" in lines
    assert f"| {bench_overhead.STREAMING} | 500 | 0.50 | 500x |" in lines
    assert lines[-2].startswith("streaming with overlap adds at most 3% wall time: PASS (overhead +1.5%")
    assert lines[-1] == "streaming fp4 at H=100 sends >= 400x fewer bytes per token than ddp: PASS (ratio 500.0)"
    runs[bench_overhead.STREAMING] = [_overhead_run(10.1), _overhead_run(20.4)]  # sent nothing: the check fails
    assert bench_overhead.report("setup", runs, _overhead_run(5.0, 10, 250.0)).endswith("FAIL (ratio 0.0)")


def test_bench_overhead_excess_counts_the_steps_from_launch_to_apply():
    records = [{"step": s, "train/step_ms": 10.0} for s in range(1, 11)]
    records[4]["train/step_ms"] = records[5]["train/step_ms"] = 20.0  # steps 5 and 6: launch (τ=1) and apply
    records[5]["outer/sync_ms"] = 8.0
    assert bench_overhead.outer_excess_pct(records, delay=1) == pytest.approx(100.0 * 20 / (10 * 10))
    assert bench_overhead.outer_excess_pct(records, delay=0) == pytest.approx(100.0 * 10 / (10 * 10))
    assert bench_overhead.outer_excess_pct([], delay=1) == 0.0


def test_bench_restart_report_gives_medians_and_the_exec_fork_ratios():
    def mode(spawn: str, seconds: list[float], cpu: list[float], server: float | None) -> bench_restart.Mode:
        restarts = [bench_restart.Restart(s, c, healed=i == 0) for i, (s, c) in enumerate(zip(seconds, cpu))]
        return bench_restart.Mode(spawn, restarts, server)

    modes = {"exec": mode("exec", [6.0, 8.0], [4.0, 6.0], None), "fork": mode("fork", [2.0, 3.0], [0.5, 1.5], 3.0)}
    lines = bench_restart.report(modes, 3).splitlines()
    assert lines[0].startswith("Restarting a SIGKILLed group (3 groups x 1 CPU worker")
    assert lines[4:6] == [
        "| exec | 2 | 7.00 | 8.00 | 5.00 | 6.00 | 1/2 |",
        "| fork | 2 | 2.50 | 3.00 | 1.00 | 1.50 | 1/2 |",
    ]
    assert lines[-1].startswith("exec / fork: 2.8x the seconds to first commit, 5.0x the worker CPU (medians);")
    assert lines[-1].endswith("once per job: 3.0 CPU s")


@pytest.mark.slow
def test_bench_sync_quick(tmp_path, capsys):
    out = run_script(
        "experiments.parallelism.bench_sync", tmp_path, capsys, "--steps", "10"
    )  # steps 11-20: one sync per group
    assert re.search(r"^\| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.MULTILINE), out
    assert (tmp_path / "bench_sync.md").read_text().strip() == out.strip()


@pytest.mark.slow
def test_bench_overhead_quick(tmp_path, capsys):
    out = run_script("experiments.parallelism.bench_overhead", tmp_path, capsys)
    ratio = re.search(r"fewer bytes per token than ddp: (PASS|FAIL) \(ratio ([\d.]+)\)$", out, re.MULTILINE)
    assert ratio and float(ratio.group(2)) >= 400, out
    assert (tmp_path / "bench_overhead.md").read_text().strip() == out.strip()


@pytest.mark.slow
def test_bench_restart_quick(tmp_path, capsys):
    out = run_script("experiments.fault_tolerance.bench_restart", tmp_path, capsys, "--kills", "1")
    for spawn in ("exec", "fork"):
        assert re.search(rf"^\| {spawn} \| 1 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d/1 \|$", out, re.MULTILINE), (
            out
        )
    assert (tmp_path / "bench_restart.md").read_text().strip() == out.strip()


@pytest.mark.slow
def test_bench_muon_times_both_ways_and_gives_the_ratio(tmp_path, capsys):
    args = ["--model", "tiny", "--steps", "1", "--warmup", "0", "--results", str(tmp_path)]
    out, _ = run_main("experiments.parallelism.bench_muon", args, TIMEOUT_S, capsys)
    assert re.search(r"^\| FSDP2 x 2, spread over the workers \| \d+ \| [\d.]+ \|$", out, re.MULTILINE), out
    assert (tmp_path / "bench_muon.md").read_text().strip() in out


def test_each_cost_is_read_as_a_fixed_part_and_a_per_byte_part_beside_its_bare_figure():
    """Costs on exact lines give back their lines; the per-byte ratio is the two slopes'."""
    assert cost_lines.linear_fit([(1.0, 12.0), (10.0, 30.0), (100.0, 210.0)]) == pytest.approx((10.0, 2.0))
    assert cost_lines.linear_fit([(1.0, 5.0)]) is None and cost_lines.linear_fit([(1.0, 5.0), (2.0, 0.0)]) is None
    params = (1e6, 1e7, 1e8)  # the round's 4 bytes a parameter: 0.004, 0.04 and 0.4 GB
    rows = [
        {"parameters": n, "sync_ms": 5 + 3000 * 4 * n / 1e9, "allreduce_ms": 1 + 1000 * 4 * n / 1e9} for n in params
    ]
    (line,) = [r for r in cost_lines.fit_table(rows).splitlines() if r.startswith("| round")]
    assert line == "| round (sync_ms) | 5.0 | 3,000 | bare all-reduce | 1.0 | 1,000 | 3.0x |", line
    assert cost_lines.fit_table(rows[:1]) == "(a fit needs two sizes or more)"


def test_the_bench_payloads_and_layouts_compose_at_150m_and_each_lane_rounds_bytes_are_its_codecs():
    numel = 151_544_832  # llama3_150m
    collectives = {name: v.collective("llama3_150m", numel) for name, v in bench_model_size.VARIANTS.items()}
    assert collectives["fp32"] == ("allreduce", numel)
    assert collectives["fp32, 2 x 2 FSDP2"] == ("allreduce", numel // 2), "each lane carries its worker's shard"
    kind, fp4_bytes = collectives["streaming P=4 τ=1 fp4"]
    assert kind == "allgather" and numel // 4 // 2 < fp4_bytes < numel // 4 // 2 * 1.1, "half a byte a value, scales"
    assert collectives["sparse 1% 2-bit"][0] == "allgather" and collectives["sparse 1% 2-bit"][1] < numel * 0.01 * 2
    assert "larger than the model's 2 transformer blocks" in bench_model_size.VARIANTS["streaming P=4 τ=1 fp4"].misfit(
        "tiny"
    )
    phases = {p: 1.0 for p in bench_model_size.PHASES}
    job = {"ok": True, "sync_ms": 30.0, "phases_ms": phases, "heal_ms": 9.0, "death_to_commit_s": 2.5}
    job |= {"peak_rss_mb": 300.0, "healed_peak_rss_mb": 340.0, "plain_peak_rss_mb": 296.0}
    row = {"size": "tiny", "parameters": 1 << 20, "allreduce_ms": 10.0, "collective_ms": {"sparse 1% 2-bit": 2.0}}
    row |= job | {
        "variants": {"sparse 1% 2-bit": job | {"collective": "allgather", "round_bytes": 1 << 19, "bare_ms": 2.0}}
    }
    lines = bench_model_size.variants_table([row]).splitlines()
    assert lines[2].startswith("| tiny | fp32 | 4 | 10 (all-reduce) | 30 | 3.0x |"), lines
    assert lines[3].startswith("| tiny | sparse 1% 2-bit | 0.5 | 2 (all-gather) | 30 | 15.0x |"), lines
    assert lines[2].endswith("| 300 / 340 / 296 | 4.0 / 44.0 |"), "MB, then bytes a parameter beside the plain loop"


@pytest.mark.slow
def test_bench_model_size_quick_times_every_phase_of_a_round_and_a_heal_beside_the_bare_figures(tmp_path, capsys):
    out = run_script("experiments.scale.bench_model_size", tmp_path, capsys)
    (row,) = json.loads((tmp_path / "bench_model_size.json").read_text())
    assert row["ok"] and row["size"] == "tiny" and row["parameters"] == 131_392, out
    assert set(row["phases_ms"]) == set(bench_model_size.PHASES) and row["phases_ms"]["wire"] > 0, out
    assert row["allreduce_ms"] > 0 and row["send_ms"] > 0 and row["heal_transfer_ms"] > 0, out
    assert set(row["outer_step_alone_ms"]) == {"torch", "in place"} and min(row["outer_step_alone_ms"].values()) > 0
    bytes_by_kind = row["heal_bytes"]
    assert bytes_by_kind["theta_g"] == bytes_by_kind["outer state"] == 4 * 131_392, bytes_by_kind
    assert bytes_by_kind["inner state"] >= 8 * 131_392, bytes_by_kind  # AdamW's two moments, and its steps
    assert row["heal_ms"] is not None and row["death_to_commit_s"] is not None, out
    assert min(row[k] for k in ("peak_rss_mb", "healed_peak_rss_mb", "plain_peak_rss_mb")) > 0, row
    assert row["checkpoint_bytes"] == len(checkpoint_io.KINDS) * 4 * 131_392, row  # 20 bytes a parameter
    assert min(row[k] for k in ("raw_write_ms", "raw_write_synced_ms", "raw_read_ms", "save_ms", "load_ms")) > 0, row
    again, _ = run_main(
        "experiments.scale.bench_model_size",
        ["--from", str(tmp_path / "bench_model_size.json"), "--results", str(tmp_path / "again")],
        TIMEOUT_S,
        capsys,
    )
    assert again.split("\n\n")[0] in out and "(a fit needs two sizes or more)" in again, again
    assert "| tiny | 0.1M |" in out
