"""Config composition and validation: every error names the key and what is allowed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml
from hydra.errors import ConfigCompositionException

from diloco.config.base import ConfigError, to_dict
from diloco.config.job import JobConfig, job_config_from_dict
from diloco.exits import REFUSED_EXIT_CODE
from diloco.launch.compose import compose_raw, output_folder_problem
from diloco.launch.local_cluster import free_port
from tests.conftest import CONF_DIR, FAST, REPO, compose_job


def test_default_config_is_the_embedded_default():
    job = compose_job([])
    assert job.role == "local"
    assert job.cluster.groups == 2 and job.cluster.workers_per_group == 2
    assert job.algo.name == "diloco" and job.outer_opt.name == "nesterov"
    assert job.logger.mode == "offline"
    assert job.data.corpus == "stdlib"
    assert job.model.vocab_size == job.data.vocab_size == 256


GROUPS = sorted(path.name for path in CONF_DIR.iterdir() if path.is_dir())


def _options(group: str) -> list[str]:
    return [option.stem for option in sorted((CONF_DIR / group).glob("*.yaml"))]


def _selection(group: str, option: str) -> list[str]:
    """The overrides that pick ``option`` of ``group``, as a user would type them."""
    if group == "experiment":
        return [f"+experiment={option}"]  # config.yaml names no experiment: appended, as in the README
    overrides = [f"{group}={option}"]
    if group == "faults" and option in ("soak", "seed_topology_15s", "seed_topology_60s"):
        overrides.append("cluster.groups=3")  # its min_alive=2 needs two other groups for a kill to happen
    if group == "data" and option != "stdlib":
        overrides.append(f"data.path={CONF_DIR / 'config.yaml'}")  # any existing file will do for composition
        if option == "tokens":
            overrides.append("data.vocab_size=512")
    return overrides


def test_every_group_of_conf_is_covered():
    assert {"model", "algo", "cluster", "faults", "experiment"} <= set(GROUPS), GROUPS


# The key that names what a preset is: a preset that leaves it to the default must still be
# what its file is called, whatever the dataclass's default becomes.
IDENTITY = {"algo": "name", "inner_opt": "name", "outer_opt": "name", "data": "corpus"}


@pytest.mark.slow  # hydra composes every option (~15 s in all)
@pytest.mark.parametrize("group", GROUPS)
def test_every_option_of_every_group_composes(group):
    for option in _options(group):
        job = compose_job(_selection(group, option))
        if group in IDENTITY:
            assert getattr(getattr(job, group), IDENTITY[group]) == option, f"{group}={option}"


def _restated_defaults(preset: dict, defaults: dict, where: str) -> list[str]:
    restated = []
    for key, value in preset.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            restated += _restated_defaults(value, default, f"{where}.{key}")
        elif key in defaults and value == (list(default) if isinstance(default, tuple) else default):
            restated.append(f"{where}.{key}={value!r}")
    return restated


@pytest.mark.parametrize("group", [g for g in GROUPS if g != "experiment"])
def test_presets_hold_only_deltas_over_the_dataclass_defaults(group):
    """A default lives in its dataclass only; a preset that restates one would hide a change to it.

    (Experiment presets pin what their measurement depends on, default or not.)"""
    defaults = to_dict(JobConfig())[group]
    for option in _options(group):
        preset = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text()) or {}
        preset.pop("defaults", None)
        restated = _restated_defaults(preset, defaults, group)
        assert not restated, f"conf/{group}/{option}.yaml restates dataclass defaults: {', '.join(restated)}"


def test_the_default_composition_is_the_dataclass_defaults():
    """config.yaml's presets add nothing: ``python run.py`` runs ``JobConfig()``, whose
    model.vocab_size is left to follow data.vocab_size."""
    expected = to_dict(JobConfig())
    del expected["model"]["vocab_size"]
    assert compose_raw([]) == json.loads(json.dumps(expected))  # tuples as lists
    assert compose_job([]) == JobConfig()


def _leaves(node: dict, where: str = "") -> list[tuple[str, object]]:
    leaves = []
    for key, value in node.items():
        path = f"{where}.{key}" if where else key
        leaves += _leaves(value, path) if isinstance(value, dict) else [(path, value)]
    return leaves


def _typed(value: object) -> str:
    """``value`` as hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(map(_typed, value)) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if value == "" else str(value)


def test_every_key_is_overridable_without_a_plus():
    """Presets are deltas, yet every key exists before the command line applies: plain
    ``key=value`` reaches each one (here every key set to its own default)."""
    overrides = [f"{key}={_typed(value)}" for key, value in _leaves(compose_raw([]))]
    assert len(overrides) > 80, overrides
    assert job_config_from_dict(compose_raw(overrides)) == JobConfig()


@pytest.mark.parametrize(
    "overrides",
    [
        FAST,
        ["cluster.groups=4", "+experiment=compare_ddp"],  # a value before a selection; an interpolation follows it
        ["model=mini", "algo=streaming", "algo.fragments=2", "inner_opt.betas=[0.8,0.9]", "data.path=null"],
        ["faults=soak", "cluster.groups=3", "faults.kill_every=2.5", "logger=none", "trainer.resume=''"],
        ["++trainer.seed=3", "++model.vocab_size=256", "~trainer.resume", "+algo={sync_every:10}"],
    ],
)
def test_the_shortcut_composes_as_hydra_does(overrides):
    """Tests compose the group selections once and apply key=value overrides to a copy
    (tests/conftest.py); the result must be hydra's in one go."""
    assert compose_job(overrides) == job_config_from_dict(compose_raw(overrides))


def test_the_shortcut_refuses_an_unknown_key_as_hydra_does():
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'algo\.nope'"):
        compose_job(["logger=none", "algo.nope=1"])


def test_an_unknown_key_is_refused_at_composition():
    """The base config makes every key known, so hydra's struct mode still catches a typo."""
    with pytest.raises(ConfigCompositionException, match=r"Could not override 'algo\.nope'"):
        compose_raw(["algo.nope=1"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.batch_size=0"], r"trainer\.batch_size=0: must be a positive integer"),
        (["trainer.max_steps=abc"], r"trainer\.max_steps='abc': must be an integer"),
        (["cluster.device=tpu"], r"cluster\.device='tpu': must be one of auto, cpu, cuda"),
        (["cluster.timeouts.collective=0"], r"cluster\.timeouts\.collective"),
        (["inner_opt.lr=-1"], r"inner_opt\.lr=-1\.0: must be > 0"),
        (["inner_opt.betas=[0.9,1.5]"], r"inner_opt\.betas\[1\]"),
        (["data=text"], r"data\.path=None: required"),
        (["trainer.seq_len=4096"], r"trainer\.seq_len=4096: exceeds model\.max_seq_len"),
        (["model.n_kv_heads=3"], r"model\.n_kv_heads"),
        (["+model.vocab_size=200"], r"model\.vocab_size=200: is smaller than the tokenizer.s .* data\.vocab_size=256"),
        (["group.id=3"], r"group\.id=3: must be in \[0, cluster\.groups=2\)"),
        (
            ["model=small", "algo=streaming", "algo.sync_every=30", "algo.fragments=4"],
            r"algo\.sync_every=30 is not divisible",
        ),
        (["algo=streaming", "algo.delay=50"], r"algo\.delay=50"),
        (["algo.fragments=2"], r"algo\.fragments=2 does nothing with algo=diloco.*use algo=streaming"),
        (["outer_opt.name=adagrad"], r"outer_opt\.name='adagrad': must be one of"),
        (["cluster.min_groups=3"], r"cluster\.min_groups=3"),
        (["role=boss"], r"role='boss': must be one of local, lighthouse, group"),
        (["cluster.spares=-1"], r"cluster\.spares=-1: must be >= 0"),
        (["algo.diverged_rounds=-1"], r"algo\.diverged_rounds=-1: must be an integer >= 0"),
        (
            ["trainer.activation_checkpoint=some"],
            r"trainer\.activation_checkpoint='some': must be one of none, full, selective",
        ),
        (["cluster.peak_tflops=-1"], r"cluster\.peak_tflops=-1\.0: must be >= 0 TFLOP/s per device"),
        (["role=group", "cluster.spares=1"], r"cluster\.spares=1: warm spares are kept by the local launcher"),
        (["parallel.tp=0"], r"parallel\.tp=0: must be a positive integer"),
        (
            ["parallel.sequence_parallel=true"],
            r"parallel\.sequence_parallel=True: splits the sequence .* set parallel\.tp > 1",
        ),
        (
            ["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.seq_len=63"],
            r"parallel\.tp=2: must divide trainer\.seq_len=63 with parallel\.sequence_parallel=true",
        ),
        (["parallel.tp=2", "trainer.compile=true"], r"trainer\.compile=True: does not compose with parallel\.tp=2 yet"),
        (["parallel.tp=4"], r"parallel\.tp=4: must divide cluster\.workers_per_group=2 \(dp x tp workers\)"),
        (["parallel.tp=4", "cluster.workers_per_group=4"], r"parallel\.tp=4: must divide model\.n_kv_heads=2"),
        (
            ["parallel.tp=4", "cluster.workers_per_group=4", "model.n_heads=6", "model.n_kv_heads=6", "model.dim=96"],
            r"parallel\.tp=4: must divide model\.n_heads=6",
        ),
        (
            ["parallel.tp=2", "model.ffn_hidden_dim=171"],
            r"parallel\.tp=2: must divide the MLP width \(model\.ffn_hidden_dim\)=171",
        ),
        (["parallel.pp=3"], r"parallel\.pp=3: pp x tp = 3 must divide cluster\.workers_per_group=2"),
        (["parallel.pp=2", "parallel.tp=2"], r"parallel\.pp=2: pp x tp = 4 must divide cluster\.workers_per_group=2"),
        (
            ["parallel.pp=4", "cluster.workers_per_group=4"],
            r"parallel\.pp=4: 4 stages .* for model\.n_layers=2 blocks: every stage needs at least one",
        ),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
            r"parallel\.pp=2: 4 stages \(pp x pp_stages_per_rank=2\) for model\.n_layers=2 blocks",
        ),
        (["parallel.pp=2", "trainer.microbatches=3"], r"trainer\.microbatches=3: must divide trainer\.batch_size=8"),
        (["parallel.pp=2", "trainer.microbatches=1"], r"trainer\.microbatches=1: must be >= parallel\.pp=2 for .*1f1b"),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "model.n_layers=4"]
            + ["trainer.batch_size=6", "trainer.microbatches=3"],
            r"trainer\.microbatches=3: must be a multiple of parallel\.pp=2 for pp_schedule=interleaved_1f1b",
        ),
        (["trainer.microbatches=2"], r"trainer\.microbatches=2: cuts batches for pipeline stages only"),
        (["parallel.pp=2", "model.tie_embeddings=true"], r"parallel\.pp=2: cannot split a model with tied embeddings"),
        (["parallel.pp=2", "parallel.pp_split=[1]"], r"parallel\.pp_split=\[1\]: must give a positive block count"),
        (
            ["parallel.pp=2", "parallel.pp_split=[1,2]"],
            r"parallel\.pp_split=\[1, 2\]: must add up to model\.n_layers=2",
        ),
        (["parallel.pp=2", "parallel.pp_stages_per_rank=2"], r"pp_stages_per_rank=2: must be 1 for pp_schedule=1f1b"),
        (
            ["parallel.pp=2", "parallel.sequence_parallel=true", "parallel.tp=2", "cluster.workers_per_group=4"],
            r"parallel\.sequence_parallel=True: does not compose with parallel\.pp=2",
        ),
    ],
)
def test_invalid_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_job(overrides)


def test_unknown_key_is_refused_with_the_allowed_keys():
    raw = compose_raw([])
    raw["trainer"]["max_step"] = 3
    with pytest.raises(
        ConfigError, match=r"unknown key trainer\.max_step; did you mean trainer\.max_steps\? allowed keys of trainer: "
    ):
        job_config_from_dict(raw)


def test_job_config_round_trips_through_json_form():
    job = compose_job(["model=small", "trainer.grad_accum=2"])
    assert job_config_from_dict(to_dict(job)) == job


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={tmp_path}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.slow  # a real python + hydra + torch start (~4 s)
def test_run_py_rejects_an_invalid_value_before_starting_anything(tmp_path):
    result = _run(["trainer.batch_size=0"], tmp_path)
    assert result.returncode != 0
    assert "trainer.batch_size=0: must be a positive integer" in result.stderr
    assert not (tmp_path / "logs").exists()  # no worker was started


@pytest.mark.slow  # a real python + hydra + torch start (~4 s)
def test_run_py_names_the_allowed_presets_for_an_unknown_one(tmp_path):
    result = _run(["model=huge"], tmp_path)
    assert result.returncode != 0
    assert "tiny" in result.stderr and "llama3_1b" in result.stderr


@pytest.mark.slow
def test_run_py_refuses_a_run_directory_that_holds_a_run_and_touches_nothing(tmp_path):
    (tmp_path / "summary.json").write_text('{"syncs_committed": 6}')
    (tmp_path / "config.yaml").write_text("old: run\n")
    result = _run(["logger=none"], tmp_path)
    assert result.returncode != 0
    reason = result.stderr.strip().splitlines()[-1]
    assert reason == (
        f"error: hydra.run.dir={tmp_path}: already holds a run (summary.json); pick a new hydra.run.dir "
        "(or remove the old run)"
    )
    assert "Traceback" not in result.stderr
    assert (tmp_path / "config.yaml").read_text() == "old: run\n" and not (tmp_path / "logs").exists()


def test_an_output_folder_with_a_file_in_its_path_is_refused_in_one_line(tmp_path, monkeypatch):
    """Hydra makes the folder before run.py's main: a file in its path would end in hydra's traceback."""
    (tmp_path / "afile").touch()
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert output_folder_problem([f"hydra.run.dir={tmp_path}/afile/run"]) == (
        f"error: hydra.run.dir={tmp_path}/afile/run: {tmp_path}/afile is a file, not a folder; "
        "pick another hydra.run.dir"
    )
    assert "afile is a file" in output_folder_problem(["-m", "hydra.sweep.dir=afile/${now:%H}", "trainer.seed=1,2"])
    assert output_folder_problem(["hydra.sweep.dir=afile/x"]) is None, "a single run does not make the sweep folder"
    assert output_folder_problem(["hydra.run.dir=runs/new/deeper", "hydra.run.dir=runs/x_${now:%H}"]) is None
    assert output_folder_problem([]) is None  # the default, outputs/${now:...}, with no outputs here yet
    (tmp_path / "outputs").touch()
    assert output_folder_problem([]) == (
        "error: hydra.run.dir=outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}: outputs is a file, not a folder; "
        "pick another hydra.run.dir"
    )


@pytest.mark.slow
def test_run_py_refuses_a_run_directory_another_launcher_is_using_and_touches_nothing(tmp_path):
    holder_code = (
        "import sys, time; from pathlib import Path\n"
        "from diloco.launch.launcher import run_dir_claimed; from diloco.run_paths import RunPaths\n"
        "with run_dir_claimed(RunPaths(Path(sys.argv[1]))):\n"
        "    Path(sys.argv[1], 'config.yaml').write_text('first: launcher\\n'); print('held', flush=True)\n"
        "    time.sleep(120)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", holder_code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        result = _run(["logger=none"], tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: hydra.run.dir={tmp_path}: another launcher (pid {holder.pid}) is running a job there; "
        "pick a new hydra.run.dir"
    )
    assert (tmp_path / "config.yaml").read_text() == "first: launcher\n" and not (tmp_path / "logs").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_before_any_process_starts(tmp_path):
    result = _run(["logger=none", "cluster.device=cuda"], tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "error: cluster.device='cuda': torch sees no CUDA device on this machine; use cluster.device=cpu (or auto)"
    )
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_a_group_pointed_at_no_lighthouse_fails_at_once_naming_the_address(tmp_path):
    """A typo in the lighthouse's host or port is not an outage to train through alone."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port("127.0.0.1"))
    nothing_there = free_port("127.0.0.1")
    result = subprocess.run(
        [sys.executable, str(REPO / "run.py"), f"hydra.run.dir={tmp_path}", "role=group", "logger=none"]
        + ["cluster.groups=2", f"cluster.lighthouse.port={nothing_there}", "cluster.timeouts.connect=2"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert result.returncode == REFUSED_EXIT_CODE, "a restart would meet the same address"
    reason = result.stderr.strip().splitlines()[-1]
    assert reason.startswith(f"error: cannot reach the lighthouse at 127.0.0.1:{nothing_there} ")
    assert "within cluster.timeouts.connect=2s" in reason and "Traceback" not in result.stderr
    assert not (tmp_path / "model.pt").exists() and not (tmp_path / "results").exists()


def test_every_job_of_every_sweep_preset_composes():
    """An ``experiment`` preset that carries a sweep (``hydra.sweeper.params``) gives valid jobs
    for every value it sweeps: ``python run.py -m +experiment=NAME`` runs that grid."""
    sweeps = 0
    for option in _options("experiment"):
        preset = yaml.safe_load((CONF_DIR / "experiment" / f"{option}.yaml").read_text()) or {}
        params = preset.get("hydra", {}).get("sweeper", {}).get("params", {})
        for key, values in params.items():
            for value in str(values).split(","):
                compose_job([f"+experiment={option}", f"{key}={value.strip()}"])
                sweeps += 1
    assert sweeps >= 7, "compare_ddp_sweep (4 algorithms) and sync_every_sweep (3 values of H)"


def test_the_configuration_reference_lists_every_key_with_the_default_python_run_py_uses():
    """docs/configuration.md's key reference cannot go stale: every key, and each default as composed."""
    reference = (REPO / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_.]+)` \| ([^|]*) \|", reference, re.MULTILINE))

    def shown(value: object) -> str:
        if value is None:
            return "null"
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, (list, tuple)):
            return "[" + ", ".join(map(str, value)) + "]"
        return '""' if value == "" else str(value)

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in d.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    composed = flat(to_dict(compose_job([])))
    missing = sorted(set(composed) - set(rows))
    assert not missing, f"docs/configuration.md's key reference lacks {missing}"
    wrong = {k: (rows[k].strip(), shown(v)) for k, v in composed.items() if rows[k].strip() != shown(v)}
    assert not wrong, f"docs/configuration.md shows other defaults than python run.py composes: {wrong}"
