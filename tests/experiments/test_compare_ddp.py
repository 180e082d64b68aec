"""experiments/outer_recipe/compare_ddp.py: its presets compose, its table is right on canned run directories,
and ``--quick`` runs every algorithm it names end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing
import re
from pathlib import Path

import pytest

from diloco.config.algo import AlgoConfig
from diloco.run_paths import RunPaths
from diloco.schedule import mixing_alpha
from diloco.train.model import count_parameters, meta_model
from experiments.common import NO_MATPLOTLIB, compose_job
from experiments.outer_recipe.compare_ddp import (
    CONFIG_FILE,
    CONFIGS,
    EXPERIMENT,
    Config,
    CorePool,
    RunResult,
    band,
    by_config,
    chosen,
    collect,
    collect_kept,
    parse_args,
    plan,
    plot_bytes,
    seed_table,
    table,
    targets,
)
from tests.conftest import compose_job as compose_like_run_py
from tests.experiments.in_process import run_main

TIMEOUT_S = 300


def by_name(name: str, groups: int = 2) -> Config:
    return next(c for c in CONFIGS if c.name == name and c.groups == groups)


@pytest.mark.slow  # hydra composes every row (~6 s)
def test_every_configuration_composes_with_its_preset_and_both_models():
    for config in CONFIGS:
        job = compose_job([f"cluster.groups={config.groups}", *config.overrides], EXPERIMENT)
        assert job.algo.name == config.algo and job.cluster.groups == config.groups
        assert job.cluster.min_groups == config.groups, "fault-free: every round has every group"
    sizes = {
        name: count_parameters(meta_model(compose_job([f"model={name}"], EXPERIMENT).model))
        for name in ("mini", "midi")
    }
    assert 0.75e6 < sizes["mini"] < 0.85e6 and 4e6 < sizes["midi"] < 6e6, sizes


def test_the_preset_beats_the_benchmarks_base_as_run_py_would_compose_it():
    """compare_ddp evaluates on its preset's 16 batches, not the benchmarks' shared single batch
    (hydra applies command-line overrides after presets, so BASE must leave the preset's keys alone)."""
    job = compose_job([], EXPERIMENT)
    assert job.trainer.eval_batches == compose_like_run_py([f"+experiment={EXPERIMENT}"]).trainer.eval_batches == 16
    assert compose_job([], "soak").trainer.eval_batches == 1  # where a preset is silent, BASE still applies


def test_configurations_are_chosen_by_name_and_group_count():
    def names(*argv: str) -> list[tuple[str, int]]:
        return [(c.name, c.groups) for c in chosen(parse_args(list(argv)))]

    assert names("--only", "ddp", "diloco H=50", "--groups", "2") == [("ddp", 2), ("diloco H=50", 2)]
    assert names("--only", "ddp") == [("ddp", 2), ("ddp", 4), ("ddp", 8), ("ddp", 16), ("ddp", 30)]
    assert names("--only", "ddp", "ddp, lr 0.006", "--groups", "8") == [("ddp", 8), ("ddp, lr 0.006", 8)]
    assert names("--quick") == [("ddp", 2), ("local", 2), ("diloco H=50", 2)]
    assert len(names()) == len(CONFIGS)
    with pytest.raises(SystemExit, match="unknown configuration"):
        names("--only", "diloco H=7")


def test_the_grid_runs_seed_by_seed_and_set_applies_to_every_row_that_does_not_name_its_own(tmp_path):
    rows = ["diloco H=50", "diloco H=50, μ warm-up 500 steps"]
    argv = ["--only", *rows, "--groups", "2", "--seeds", "2", "--first-seed", "4"]
    args = parse_args([*argv, "--set", "outer_opt.momentum_warmup_steps=700"])
    planned = plan(args, tmp_path, ["model=tiny"], "tiny", 1000)
    assert [(p.config.name, p.seed, p.job.trainer.seed) for p in planned] == [
        (rows[0], 4, 4),
        (rows[1], 4, 4),
        (rows[0], 5, 5),
        (rows[1], 5, 5),
    ]
    assert [p.job.outer_opt.momentum_warmup_steps for p in planned] == [700, 500, 700, 500]
    assert planned[3].marker["seed"] == 5 and len({p.run_dir for p in planned}) == 4
    assert planned[0].marker["set"] == ["outer_opt.momentum_warmup_steps=700"], "what --collect can tell"


def test_the_paper_preset_is_the_published_outer_step_and_reset():
    job = compose_like_run_py(["+experiment=diloco_paper"])
    opt = job.outer_opt
    assert (opt.name, opt.lr, opt.momentum, opt.momentum_warmup_steps) == ("nesterov", 0.7, 0.9, 0)
    assert alpha_of(job.algo, 5000) == 0.0, "every group takes θ_g whole after each outer step"
    default = compose_like_run_py([])
    assert default.outer_opt.momentum_warmup_steps > 0, "the default recipe warms the momentum up"
    assert [alpha_of(default.algo, s) for s in (1, 500, 1000, 5000)] == [0.0005, 0.25, 0.5, 0.5], "and α"


def alpha_of(algo: AlgoConfig, s: int) -> float:
    """α(s, M = 2) of ``algo``'s keys."""
    return mixing_alpha(s, 2, algo.alpha, algo.alpha_warmup_steps, algo.alpha_reference_groups)


def test_the_sparseloco_preset_is_the_recipe_compare_ddp_measured():
    row = next(c for c in CONFIGS if c.name == "sparseloco H=20 1% 2-bit, α ramped, outer lr 1.5")
    assert compose_like_run_py(["+experiment=sparseloco"]) == compose_like_run_py(list(row.overrides))


def canned_run(
    root: Path, loss: float, curve: list[float], ok: bool = True, bytes_per_token: float = 0.0, inner_lr: float = 3e-3
) -> Path:
    """A run directory as a finished job leaves it: summary.json, job.json and group 0's metrics."""
    paths = RunPaths(root)
    paths.metrics(0).parent.mkdir(parents=True)
    steps = 100 * len(curve)
    summary = {
        "ok": ok,
        "failure": None if ok else "group 1 never committed a round",
        "final_eval_loss": loss,
        "tokens_seen": steps * 2048,
        "steps": steps,
        "bytes_per_token": bytes_per_token,
        "wall_seconds": 90.0,
        "parameters": 800_000,
    }
    paths.summary.write_text(json.dumps(summary))
    paths.job.write_text(json.dumps({"inner_opt": {"lr": inner_lr}}))
    lines = [{"step": 100 * (i + 1), "train/loss": 9.0} for i in range(len(curve))]
    lines += [{"step": 100 * (i + 1), "eval/loss": v} for i, v in enumerate(curve)]
    paths.metrics(0).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def test_table_gives_ratio_to_ddp_and_gap_closed_against_the_same_group_count(tmp_path):
    results = [
        collect(by_name("ddp"), canned_run(tmp_path / "a", 1.30, [2.0, 1.30])),
        collect(by_name("local"), canned_run(tmp_path / "b", 1.50, [2.1, 1.50])),
        collect(by_name("diloco H=50"), canned_run(tmp_path / "c", 1.35, [2.2, 1.36], bytes_per_token=12.5)),
        collect(by_name("diloco H=10"), canned_run(tmp_path / "d", 1.55, [2.2, 1.55])),
        collect(by_name("ddp", 4), canned_run(tmp_path / "e", 1.20, [1.9, 1.20])),
        collect(by_name("diloco H=50", 4), canned_run(tmp_path / "f", 9.99, [2.3], ok=False)),
    ]
    lines = table(results).splitlines()
    assert lines[0] == (
        "| config | M | seeds | eval loss, mean | worst | spread | vs ddp | gap closed, mean | worst | bytes/token"
        " | wall min |"
    )
    assert lines[2] == "| ddp | 2 | 1 | 1.3000 | 1.3000 | 0.0000 | +0.0% | 100% | 100% | 0.0 | 1.5 |"
    assert lines[3] == "| local | 2 | 1 | 1.5000 | 1.5000 | 0.0000 | +15.4% | 0% | 0% | 0.0 | 1.5 |"
    assert lines[4] == "| diloco H=50 | 2 | 1 | 1.3500 | 1.3500 | 0.0000 | +3.8% | 75% | 75% | 12.5 | 1.5 |"
    assert lines[5] == "| diloco H=10 | 2 | 1 | 1.5500 | 1.5500 | 0.0000 | +19.2% | -25% | -25% | 0.0 | 1.5 |"
    assert lines[6] == "| ddp | 4 | 1 | 1.2000 | 1.2000 | 0.0000 | +0.0% | – | – | 0.0 | 1.5 |", "no local at M=4"
    assert lines[7].startswith(
        "| diloco H=50 (failed: seed 0: group 1 never committed a round) | 4 | 1 | nan | nan | nan | – | – | – |"
    )
    assert targets(results) == [
        "- gap closed by DiLoCo M=2 H=50 with the defaults: mean 75%, worst 75% (1 seeds)",
        "- DiLoCo worse than local: diloco H=10 M=2 seed 0",
    ]
    # the curve: job tokens at each evaluation; the last point is the final (global) model's loss
    assert results[2].curve == [(100 * 2048, 2.2), (200 * 2048, 1.35)]
    assert [v for _, v in results[0].curve] == [2.0, 1.30]
    assert math.isnan(results[5].loss)


def test_runs_kept_by_several_invocations_make_one_table_in_the_tables_order(tmp_path):
    def kept(where: Path, config: Config, loss: float, steps: int = 5000, seed: int | None = None) -> None:
        canned_run(where, loss, [2.0, loss])
        row = {"name": config.name, "groups": config.groups, "overrides": list(config.overrides)}
        row |= {"model": "mini", "steps": steps} | ({} if seed is None else {"seed": seed})  # none: an older run
        (where / CONFIG_FILE).write_text(json.dumps(row))

    kept(tmp_path / "session2" / "run0", by_name("diloco H=50", 4), 1.10)
    kept(tmp_path / "session1" / "run1", by_name("diloco H=50"), 1.07)
    kept(tmp_path / "session1" / "run0", by_name("ddp"), 1.06)
    (tmp_path / "session2" / "unfinished").mkdir()
    (tmp_path / "session2" / "unfinished" / CONFIG_FILE).write_text("{}")  # no summary yet: left out
    results, model, steps, device = collect_kept([tmp_path / "session1", tmp_path / "session2"])
    assert [(r.config.name, r.config.groups) for r in results] == [("ddp", 2), ("diloco H=50", 2), ("diloco H=50", 4)]
    assert (model, steps, device) == ("mini", 5000, "cpu") and results[1].loss == 1.07
    kept(tmp_path / "session2" / "run1", by_name("diloco H=50"), 1.05, seed=1)
    results, *_ = collect_kept([tmp_path / "session1", tmp_path / "session2"])
    assert [(r.config.name, r.seed, r.loss) for r in results][1:3] == [
        ("diloco H=50", 0, 1.07),
        ("diloco H=50", 1, 1.05),
    ]
    kept(tmp_path / "session3" / "run0", by_name("local"), 1.2, steps=1000)
    with pytest.raises(SystemExit, match="need finished runs of one model, length and device"):
        collect_kept([tmp_path])


@pytest.mark.slow
def test_compare_ddp_quick_at_two_seeds_two_jobs_at_a_time(tmp_path, capsys):
    args = ["--quick", "--seeds", "2", "--first-seed", "1", "--jobs", "2", "--results", str(tmp_path)]
    out, _ = run_main("experiments.outer_recipe.compare_ddp", args, TIMEOUT_S, capsys)
    rows = re.findall(
        r"^\| (ddp|local|diloco H=50) \| 2 \| 2 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", out, re.MULTILINE
    )
    assert [r[0] for r in rows] == ["ddp", "local", "diloco H=50"], out
    assert all(float(r[2]) < 5.0 for r in rows), f"every run trained below the untrained ln 256 = 5.55:\n{out}"
    assert all(float(r[3]) > 0 for r in rows), f"the seeds are different runs:\n{out}"
    assert "| config | M | seed 1 | seed 2 |" in out and "trainer.seed 1, 2." in out
    assert "gap closed by DiLoCo M=2 H=50 with the defaults" in out
    assert (tmp_path / "compare_ddp_tiny_100.md").read_text().strip() == out.strip()
    if importlib.util.find_spec("matplotlib") is None:  # CI installs .[dev] only
        assert NO_MATPLOTLIB in out
    else:
        assert (tmp_path / "compare_ddp_tiny_100.png").stat().st_size > 0


def test_at_many_groups_the_baseline_is_data_parallel_at_its_best_inner_lr(tmp_path):
    """M = 8: ddp ran at three inner lrs; every ratio and gap is against the best of them, and the
    targets say which lr was kept. A failed lr is passed over."""
    runs = [("ddp", 1.30, 3e-3), ("ddp, lr 0.006", 1.25, 6e-3), ("ddp, lr 0.0015", 1.40, 1.5e-3)]
    runs += [("local", 1.50, 3e-3), ("diloco H=50", 1.35, 3e-3)]
    results = [
        collect(by_name(name, 8), canned_run(tmp_path / name, loss, [loss], inner_lr=lr)) for name, loss, lr in runs
    ]
    diloco = table(results).splitlines()[6]
    assert diloco == "| diloco H=50 | 8 | 1 | 1.3500 | 1.3500 | 0.0000 | +8.0% | 60% | 60% | 0.0 | 1.5 |", diloco
    assert targets(results)[1:] == [
        "- ddp M=8 seed 0: inner lr 0.006 kept (of 0.0015: 1.4000, 0.003: 1.3000, 0.006: 1.2500)",
        "- DiLoCo M=8 H=50 against ddp: mean +8.0%, worst +8.0%",
    ]
    failed = collect(by_name("ddp, lr 0.006", 8), canned_run(tmp_path / "nan", 1.0, [1.0], ok=False, inner_lr=6e-3))
    results[1] = failed
    assert "| diloco H=50 | 8 | 1 | 1.3500 | 1.3500 | 0.0000 | +3.8% | 75% |" in table(results)


def test_a_failed_baseline_gives_no_ratio_instead_of_nan(tmp_path):
    results = [
        collect(by_name("ddp"), canned_run(tmp_path / "a", 1.30, [1.30], ok=False)),
        collect(by_name("local"), canned_run(tmp_path / "b", 1.50, [1.50])),
        collect(by_name("diloco H=50"), canned_run(tmp_path / "c", 1.35, [1.35])),
    ]
    assert (
        table(results).splitlines()[4] == "| diloco H=50 | 2 | 1 | 1.3500 | 1.3500 | 0.0000 | – | – | – | 0.0 | 1.5 |"
    )
    assert targets(results) == ["- DiLoCo worse than local: none"]


def test_muon_rows_close_the_gap_against_data_parallel_with_muon_and_the_better_of_the_two(tmp_path):
    losses = {"ddp": 1.30, "local": 1.50, "ddp, muon": 1.20, "local, muon": 1.45, "diloco H=50": 1.35}
    losses["diloco H=50, muon"] = 1.25
    results = [collect(by_name(n), canned_run(tmp_path / n, loss, [loss])) for n, loss in losses.items()]
    line = next(t for t in targets(results) if "Muon-inner" in t)
    # (1.45 - 1.25) / (1.45 - 1.20) against ddp with Muon, the better ddp too; 1.25 / 1.35 - 1 against AdamW-inner
    assert line == (
        "- gap closed by Muon-inner DiLoCo M=2 H=50: mean 80% against ddp with Muon, "
        "80% against the better ddp of the two; against AdamW-inner DiLoCo worst -7.4%"
    )


def test_the_sparse_row_with_muon_is_weighed_against_dense_diloco_with_muon_seed_by_seed(tmp_path):
    sparse, dense = "sparseloco H=20 1% 2-bit, α ramped, outer lr 1.75, muon", "diloco H=50, muon"
    results = [
        collect(by_name(name, 4), canned_run(tmp_path / f"{name}-{seed}", loss, [loss]), seed)
        for name, seed, loss in [
            (dense, 1, 0.90),
            (sparse, 1, 0.99),
            (dense, 2, 1.00),
            (sparse, 2, 1.02),
            (sparse, 3, 2.0),
        ]
    ]
    results.append(collect(by_name("diloco H=50", 4), canned_run(tmp_path / "adamw", 0.5, [0.5]), 1))  # not Muon's
    line = next(t for t in targets(results) if "with Muon" in t)
    assert line == f"- M=4: {sparse} against DiLoCo H=50 with Muon: mean +6.0%, worst +10.0%", "seed 3 has no pair"


def test_sparse_rows_are_their_own_family_and_the_target_line_picks_the_best_frugal_one(tmp_path):
    sparse, dense = by_name("sparseloco H=50 2% 2-bit"), by_name("diloco H=50")
    assert sparse.family == "sparseloco" and dense.family == "diloco" and sparse.algo == "diloco"
    results = [
        collect(by_name("ddp"), canned_run(tmp_path / "a", 1.30, [1.30], bytes_per_token=3140.0)),
        collect(by_name("local"), canned_run(tmp_path / "b", 1.50, [1.50])),
        collect(dense, canned_run(tmp_path / "c", 1.35, [1.35], bytes_per_token=62.8)),
        collect(sparse, canned_run(tmp_path / "d", 1.36, [1.36], bytes_per_token=0.6)),
        collect(by_name("sparseloco H=20 3% 2-bit"), canned_run(tmp_path / "e", 1.55, [1.55], bytes_per_token=2.0)),
    ]
    lines = targets(results)
    assert "- DiLoCo worse than local: none" in lines, "a sparse row is not DiLoCo in that line"
    assert lines[-1] == (
        "- M=2: sparseloco H=50 2% 2-bit sends 5,233x fewer bytes per token than ddp, loss +0.74% against DiLoCo H=50"
    )


def test_the_bytes_plot_is_drawn_or_says_why_not(tmp_path):
    results = [
        collect(by_name("ddp"), canned_run(tmp_path / "a", 1.30, [1.30], bytes_per_token=3140.0)),
        collect(by_name("local"), canned_run(tmp_path / "b", 1.50, [1.50])),
        collect(by_name("sparseloco H=50 2% 2-bit"), canned_run(tmp_path / "c", 1.36, [1.36], bytes_per_token=0.6)),
    ]
    drawn = plot_bytes(results, tmp_path / "bytes.png", "title")
    if importlib.util.find_spec("matplotlib") is None:
        assert drawn == NO_MATPLOTLIB
    else:
        assert (tmp_path / "bytes.png").stat().st_size > 0


def test_seeds_give_mean_worst_and_spread_each_seed_against_its_own_baselines(tmp_path):
    def run(name: str, seed: int, loss: float, groups: int = 2, curve: tuple[float, ...] = ()) -> RunResult:
        where = canned_run(tmp_path / f"{name}-{groups}-{seed}", loss, [*curve, loss])
        return collect(by_name(name, groups), where, seed)

    results = [
        *(run("ddp", s, loss) for s, loss in ((1, 1.30), (2, 1.34))),
        *(run("local", s, loss) for s, loss in ((1, 1.50), (2, 1.50))),
        run("diloco H=50", 1, 1.35, curve=(2.0,)),
        run("diloco H=50", 2, 1.46, curve=(2.4,)),  # 25% of its own seed's gap: ddp 1.34 there
        *(run("diloco H=100", s, loss) for s, loss in ((1, 1.40), (2, 1.52))),
        *(run("streaming H=100 P=4 τ=1 fp4", s, loss) for s, loss in ((1, 1.386), (2, 1.52))),
        *(run("ddp", s, loss, groups=4) for s, loss in ((1, 1.20), (2, 1.00))),
        *(run("diloco H=50", s, loss, groups=4) for s, loss in ((1, 1.26), (2, 1.01))),
    ]
    lines = table(results).splitlines()
    assert lines[4] == "| diloco H=50 | 2 | 2 | 1.4050 | 1.4600 | 0.1100 | +6.4% | 50% | 25% | 0.0 | 1.5 |"
    assert seed_table(results).splitlines()[4] == "| diloco H=50 | 2 | 1.3500 (75%) | 1.4600 (25%) |"
    assert targets(results) == [
        "- gap closed by DiLoCo M=2 H=50 with the defaults: mean 50%, worst 25% (2 seeds)",
        "- DiLoCo worse than local: diloco H=100 M=2 seed 2, streaming H=100 P=4 τ=1 fp4 M=2 seed 2",
        "- DiLoCo M=4 H=50 against ddp: mean +3.0%, worst +5.0%",
        "- streaming vs DiLoCo at H=100: mean -0.50%, worst +0.00%",
    ]
    # the plot's band: at each evaluation the mean, the best and the worst seed
    (default,) = [row for row in by_config(results) if row.config == by_name("diloco H=50")]
    tokens, mean, best, worst = band(default)
    assert len(tokens) == 2 and mean == pytest.approx([2.2, 1.405]) and (best, worst) == ([2.0, 1.35], [2.4, 1.46])


def test_concurrent_jobs_borrow_a_core_per_worker_and_give_them_back():
    pool = CorePool(multiprocessing.get_context("spawn"))
    with pool.lend(1) as one:
        with pool.lend(len(pool.cores) - 1) as rest:
            assert len(one) == 1 and one.isdisjoint(rest) and one | rest == set(pool.cores)
    with pool.lend(len(pool.cores) + 3) as everything:  # more workers than cores: they share all of them
        assert everything == set(pool.cores)
