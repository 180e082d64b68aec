"""``algo.*`` keys an algorithm does not read: refused in a single run, said and ignored in a sweep."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from diloco.config.algo import KEYS_READ, READS, RUNS_WITH, AlgoConfig
from diloco.config.base import ConfigError
from diloco.launch.compose import compose_raw
from tests.conftest import REPO, compose_job

ALGOS = sorted(READS)


def test_the_table_names_every_algorithm_and_every_key():
    names = {f.name for f in dataclasses.fields(AlgoConfig)} - {"name"}
    assert set(ALGOS) == {"ddp", "local", "diloco", "streaming"}
    assert set(READS["streaming"]) == names, "streaming reads every algo.* key"
    for algo in ALGOS:
        assert set(READS[algo]) <= names and set(RUNS_WITH.get(algo, {})) <= names


@pytest.mark.parametrize("algo", ALGOS)
def test_every_algo_preset_passes_on_its_own(algo):
    assert KEYS_READ.unread(compose_job([f"algo={algo}"]).algo) == {}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # three that were once accepted without a word
        (["algo=ddp", "algo.alpha=0.9"], r"^algo\.alpha=0\.9 does nothing with algo=ddp, .*use algo=diloco or"),
        (["algo=ddp", "algo.fragments=2"], r"^algo\.fragments=2 does nothing with algo=ddp, .*use algo=streaming"),
        (["algo=local", "algo.quantize=fp4"], r"^algo\.quantize='fp4' does nothing with algo=local, "),
        # the same kind
        (["algo=ddp", "algo.sync_every=50"], r"^algo\.sync_every=50 does nothing with algo=ddp"),
        (["algo=ddp", "algo.delay=1"], r"^algo\.delay=1 does nothing with algo=ddp"),
        (["algo=ddp", "algo.quantize=int8"], r"^algo\.quantize='int8' does nothing with algo=ddp"),
        (["algo=ddp", "algo.alpha_warmup_steps=0"], r"^algo\.alpha_warmup_steps=0 does nothing with algo=ddp"),
        (["algo=local", "algo.sync_every=10"], r"^algo\.sync_every=10 does nothing with algo=local"),
        (["algo=local", "algo.pattern=sequential"], r"^algo\.pattern='sequential' does nothing with algo=local"),
        (["algo=local", "algo.alpha_reference_groups=0"], r"^algo\.alpha_reference_groups=0 does nothing"),
        (["algo=diloco", "algo.pattern=sequential"], r"^algo\.pattern='sequential' does nothing with algo=diloco"),
        (["algo=diloco", "algo.auto=true"], r"^algo\.auto=True does nothing with algo=diloco.*use algo=streaming"),
        (
            ["algo=diloco", "algo.fragments=2", "algo.delay=1"],
            r"^algo\.fragments=2, algo\.delay=1 do nothing with algo=diloco, .*remove them, or use algo=streaming",
        ),
        (["algo=ddp", "algo.weighting=tokens"], r"^algo\.weighting='tokens' does nothing with algo=ddp"),
        (["algo=local", "algo.diverged_rounds=0"], r"^algo\.diverged_rounds=0 does nothing with algo=local"),
    ],
)
def test_a_key_the_algorithm_does_not_read_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        compose_job(overrides)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algo=ddp", "algo.alpha=0.5"],  # the value ddp's config holds anyway
        ["algo=ddp", "algo.sync_every=1"],  # ddp's preset
        ["algo=local", "algo.fragments=1"],
        ["algo=diloco", "algo.alpha=0.1", "algo.quantize=int8", "algo.weighting=tokens"],
        ["algo=streaming", "algo.pattern=sequential", "algo.auto=true"],
    ],
)
def test_a_key_at_the_value_the_algorithm_runs_with_or_one_it_reads_passes(overrides):
    compose_job(overrides)


def test_in_a_sweep_the_keys_are_reset_and_said_in_one_line():
    raw = compose_raw(["algo=ddp", "algo.alpha=0.3", "algo.sync_every=10"])
    said = KEYS_READ.reset(raw)
    assert said.startswith("algo.sync_every=10, algo.alpha=0.3 do nothing with algo=ddp")
    assert said.endswith("ignored in this job") and "\n" not in said
    assert raw["algo"]["alpha"] == 0.5 and raw["algo"]["sync_every"] == 1
    assert KEYS_READ.reset(compose_raw(["algo=diloco", "algo.alpha=0.3"])) is None


@pytest.mark.slow  # real python + hydra starts (~4 s)
def test_run_py_refuses_a_single_run_and_says_it_in_a_sweep(tmp_path):
    single = subprocess.run(
        [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={tmp_path / 'one'}", "algo=ddp", "algo.alpha=0.9"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert single.returncode == 1 and "Traceback" not in single.stderr
    assert single.stderr.strip().splitlines()[-1].startswith("error: algo.alpha=0.9 does nothing with algo=ddp")
    assert not (tmp_path / "one" / "logs").exists()
    # role=summary: the sweep's jobs end at once (no run there), after the warning at their start
    sweep = subprocess.run(
        [sys.executable, str(REPO / "run.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
        + ["algo=ddp,diloco", "algo.alpha=0.3", "role=summary"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    warnings = [line for line in sweep.stderr.splitlines() if "warning:" in line]
    assert warnings == [
        (
            "sweep job 0: warning: algo.alpha=0.3 does nothing with algo=ddp, which all-reduces gradients every inner "
            "step and reads no other algo.* key; ignored in this job"
        )
    ]
