"""experiments/parallelism/bench_parallel.py: its layouts compose, its tables are right on canned numbers, and
``--quick`` runs two layouts end to end."""

from __future__ import annotations

import re

import pytest

from diloco.config.base import ConfigError
from experiments.common import compose_job
from experiments.parallelism.bench_parallel import (
    BUBBLE_PIPELINES,
    BUBBLE_SHAPE,
    LAYOUTS,
    OPTIONS,
    REFUSABLE,
    SMALL,
    SMALL_LAYOUT,
    Measured,
    Options,
    bubble_table,
    compile_speedups,
    last_error,
    layout_table,
    memory_table,
    run_row,
)
from tests.experiments.in_process import run_main

TIMEOUT_S = 120
EAGER, COMPILED = Options("none", False), Options("none", True)


def test_every_layout_composes_with_the_preset_and_small_refuses_tp_4(tmp_path):
    for layout in LAYOUTS:
        for options in OPTIONS:
            overrides = layout.overrides(6) + options.overrides()
            try:
                job = compose_job(overrides, "bench_parallel")
            except ConfigError as refusal:  # compile with tp > 1 today: the script makes it a row
                assert str(refusal).startswith(REFUSABLE), refusal
                continue
            assert job.parallel.tp == layout.tp and job.cluster.workers_per_group == layout.workers
            assert job.parallel.pp == layout.pp
            assert job.trainer.compile == options.compile and job.trainer.log_every == 1
    small = compose_job(SMALL_LAYOUT.overrides(4) + SMALL, None)
    assert (small.model.dim, small.trainer.seq_len) == (384, 512)
    refused = run_row(LAYOUTS[2].overrides(4) + SMALL, None, tmp_path)
    assert refused.note.startswith("skipped: parallel.tp=4: must divide model.n_heads=6"), refused


def test_layout_table_gives_ratios_against_fsdp_of_the_same_workers_and_options():
    fsdp4, fsdp2x2, tp4, pp2, pp4, groups_fsdp, groups_tp = LAYOUTS
    results = {
        (fsdp4, EAGER): Measured(1000.0, 400.0, 2000.0, 4096),
        (fsdp2x2, EAGER): Measured(500.0, 380.0, 2000.0, 2048),
        (tp4, EAGER): Measured(note="failed: RuntimeError: boom"),
        (pp4, EAGER): Measured(250.0, 300.0, 4000.0, 1024),
        (fsdp4, COMPILED): Measured(1500.0, 440.0, 1300.0, 4096),
        (groups_fsdp, EAGER): Measured(800.0, 300.0, 1000.0, 4096),
        (groups_tp, EAGER): Measured(200.0, 330.0, 2000.0, 2048),
    }
    lines = layout_table(results).splitlines()
    assert lines[2] == "| FSDP 4 | AC none, eager | 4,096 | 1,000 | 2,000 | 400 | 1.00x | 1.00x |"
    assert lines[3] == "| FSDP 2 x TP 2 | AC none, eager | 2,048 | 500 | 2,000 | 380 | 0.50x | 0.95x |"
    assert lines[4] == "| TP 4 | AC none, eager | - | failed: RuntimeError: boom | - | - | - | - |"
    assert lines[5] == "| PP 4 | AC none, eager | 1,024 | 250 | 4,000 | 300 | 0.25x | 0.75x |"
    assert lines[6] == "| FSDP 4 | AC none, compiled | 4,096 | 1,500 | 1,300 | 440 | 1.00x | 1.00x |"
    assert lines[8] == "| 2 groups x TP 2, DiLoCo | AC none, eager | 2,048 | 200 | 2,000 | 330 | 0.25x | 1.10x |"
    assert compile_speedups(results) == "compile / eager tokens/s on this CPU: FSDP 4, AC none: 1.50x"


def test_bubble_table_sets_the_measured_idle_share_beside_the_schedules_theory():
    gpipe_m2, gpipe_m4 = BUBBLE_PIPELINES[:2]
    lines = bubble_table(
        Measured(step_ms=1000.0), {gpipe_m2: Measured(step_ms=750.0), gpipe_m4: Measured(note="failed: boom")}
    ).splitlines()
    assert lines[2:] == [
        "| PP 2, gpipe, m=2 | 750 | 1,000 | 0.33 | 0.33 |",  # 1 - 1000 / (2 x 750); (2 - 1)/(2 + 2 - 1)
        "| PP 2, gpipe, m=4 | failed: boom | 1,000 | - | 0.20 |",
    ]
    for layout in BUBBLE_PIPELINES:
        job = compose_job(layout.overrides(6) + BUBBLE_SHAPE, "bench_parallel")
        assert (job.parallel.pp, job.parallel.pp_schedule, job.trainer.microbatches) == (
            2,
            layout.schedule,
            layout.microbatches,
        )


def test_memory_table_gives_the_drop_in_peak_against_no_checkpointing():
    lines = memory_table(
        {
            "none": Measured(900.0, 1200.0),
            "full": Measured(600.0, 700.0),
            "selective": Measured(note="failed: boom"),
        }
    ).splitlines()
    assert lines[2:] == [
        "| none | 900 | 1,200 | +0 | 1.00x |",
        "| full | 600 | 700 | -500 | 0.67x |",
        "| selective | failed: boom | - | - | - |",
    ]


def test_last_error_finds_the_exception_line_of_a_log_tail():
    tail = "group 0 died:\n  File 'x.py', line 3\n    raise\nAssertionError: expected tensors\n[rank0] exiting\n"
    assert last_error(tail) == "AssertionError: expected tensors"
    assert last_error("no exception here\nlast words") == "last words"
    long = "torch._dynamo.exc.BackendCompilerFailed: " + "x" * 300
    assert last_error(long + "\nlast words", 50) == long[:47] + "..."


@pytest.mark.slow
def test_bench_parallel_quick(tmp_path, capsys):
    out, _ = run_main(
        "experiments.parallelism.bench_parallel", ["--quick", "--results", str(tmp_path)], TIMEOUT_S, capsys
    )
    for layout in ("FSDP 4", "FSDP 2 x TP 2"):
        row = rf"^\| {layout} \| AC none, eager \| [\d,]+ \| [\d,]+ \| [\d,]+ \| [\d,]+ \| [\d.]+x \| [\d.]+x \|$"
        assert re.search(row, out, re.MULTILINE), out
    assert (tmp_path / "bench_parallel.md").read_text().strip() == out.strip()
