"""A new user's first mistakes on the command line: a misspelled key or preset gets the closest one
in one line before hydra runs, and a refused run leaves no output folder behind."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from diloco.config.base import key_paths
from diloco.config.job import JobConfig
from diloco.launch.compose import existing_ancestor, key_problem_on_command_line, remove_unused_run_folder
from tests.conftest import CONF_DIR, REPO

EVERY_KEY = "(every key: docs/configuration.md)"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["trainer.max_step=100"],
            f"error: trainer.max_step is not a key; did you mean trainer.max_steps? {EVERY_KEY}",
        ),
        (
            ["+trainer.max_step=100"],
            f"error: trainer.max_step is not a key; did you mean trainer.max_steps? {EVERY_KEY}",
        ),
        (["~trainer.resum"], f"error: trainer.resum is not a key; did you mean trainer.resume? {EVERY_KEY}"),
        (["trainr.max_steps=5"], f"error: trainr.max_steps is not a key; did you mean trainer.max_steps? {EVERY_KEY}"),
        (["cluster.group=3"], f"error: cluster.group is not a key; did you mean cluster.groups? {EVERY_KEY}"),
        (["trainer.lr=1"], f"error: trainer.lr is not a key; did you mean inner_opt.lr or outer_opt.lr? {EVERY_KEY}"),
        (["max_steps=5"], f"error: max_steps is not a key; did you mean trainer.max_steps? {EVERY_KEY}"),
        (
            ["-m", "logger=none", "algo.sync_evry=10,20"],
            f"error: algo.sync_evry is not a key; did you mean algo.sync_every? {EVERY_KEY}",
        ),
    ],
)
def test_a_misspelled_key_gets_the_closest_one(argv, line):
    assert key_problem_on_command_line(argv) == line


def test_a_key_nothing_resembles_gets_its_section_keys():
    line = key_problem_on_command_line(["algo.H=5"])
    assert line.startswith("error: algo.H is not a key (the keys of algo: alpha, ") and "sync_every" in line
    assert key_problem_on_command_line(["foo=1"]).startswith("error: foo is not a key (the top-level keys: algo, ")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["model=smal"], "error: model=smal is not a preset of conf/model/; did you mean model=small? (presets: "),
        (["-m", "model=tiny,smal"], "error: model=smal is not a preset of conf/model/; did you mean model=small?"),
        (
            ["+experiment=compare_dp"],
            "error: +experiment=compare_dp is not a preset of conf/experiment/; did you mean +experiment=compare_ddp?",
        ),
        (["model=huge"], "error: model=huge is not a preset of conf/model/ (presets: llama3_150m, llama3_1b, "),
        (["+model=small"], "error: +model=small: conf/config.yaml chooses model=tiny by default; write model=small"),
        (["experiment=soak"], "error: experiment=soak: no experiment is chosen by default; write +experiment=soak"),
    ],
)
def test_a_wrong_preset_or_prefix_gets_the_one_meant(argv, line):
    assert key_problem_on_command_line(argv).startswith(line)


def test_every_key_and_every_preset_is_accepted_in_every_form():
    keys = key_paths(JobConfig)
    assert {"trainer.max_steps", "trainer.checkpoint", "trainer.checkpoint.every", "model.vocab_size"} <= set(keys)
    assert key_problem_on_command_line([f"{key}=1" for key in keys]) is None
    assert key_problem_on_command_line([f"++{key}=1" for key in keys] + [f"~{key}" for key in keys]) is None
    presets = [f"{g.name}={p.stem}" for g in CONF_DIR.iterdir() if g.is_dir() for p in g.glob("*.yaml")]
    selections = [f"+{p}" if p.startswith("experiment=") else p for p in presets]
    assert len(selections) > 40 and key_problem_on_command_line(selections) is None
    hydra_own = ["-m", "--cfg", "job", "hydra.run.dir=x", "hydra/job_logging=disabled", "hydra.job.chdir=true"]
    assert key_problem_on_command_line(hydra_own + ["model=null", "+algo={sync_every:10}", "logger=none"]) is None
    assert key_problem_on_command_line(["-cn", "other", "any.key=1"]) is None  # another config: its own keys


def test_every_key_the_configuration_reference_lists_is_accepted():
    reference = (REPO / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `([a-z_.]+)` \|", reference, re.MULTILINE)
    assert len(rows) > 100 and key_problem_on_command_line([f"{key}=1" for key in rows]) is None


def test_every_documented_command_is_accepted():
    commands = 0
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = page.read_text().replace("\\\n", " ")  # a command continued on the next line
        for found in re.finditer(r"python run\.py([^`#|\n]*)", text):
            if "..." in found.group(1):
                continue  # a template (algo=...), not a command
            argv = shlex.split(found.group(1))
            assert key_problem_on_command_line(argv) is None, f"{page.name}: python run.py {found.group(1)}"
            commands += 1
    assert commands > 50


def test_the_configuration_reference_names_every_preset_in_its_group_row():
    reference = (REPO / "docs" / "configuration.md").read_text()
    table = reference.split("## Configuration groups", 1)[1].split("\n## ", 1)[0]
    rows = {found[1]: found[0] for found in re.finditer(r"^\| `([a-z_]+)`.*$", table, re.MULTILINE)}
    missing = [
        f"conf/{preset.parent.name}/{preset.name}"
        for preset in sorted(CONF_DIR.glob("*/*"))
        if f"`{preset.stem}`" not in rows.get(preset.parent.name, "")
    ]
    assert not missing, f"docs/configuration.md's table of conf/ groups lacks {missing}"


def hydra_made(folder):
    """What hydra writes in a run's output folder as the job starts."""
    (folder / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / ".hydra" / name).write_text("x: 1\n")
    (folder / "run.log").touch()
    return folder


def test_a_refused_run_takes_back_the_folders_hydra_made_for_it(tmp_path):
    kept = tmp_path / "outputs"
    kept.mkdir()
    (kept / "2026-01-01" / "09-00-00").mkdir(parents=True)  # an earlier run of that day
    run = hydra_made(kept / "2026-01-01" / "10-00-00")
    (run / "config.yaml").write_text("role: local\n")  # resolved before the refusal: nothing else of it
    remove_unused_run_folder(run, kept, ".hydra", "run.log")
    assert sorted(p.name for p in kept.iterdir()) == ["2026-01-01"] and not run.exists()
    remove_unused_run_folder(hydra_made(tmp_path / "a" / "b"), tmp_path, ".hydra", "run.log")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    "other",
    [
        lambda run: (run / "job.json").write_text("{}\n"),
        lambda run: (run / "run.log").write_text("a line the run said\n"),
        lambda run: (run / ".hydra" / "notes.txt").write_text("mine\n"),
    ],
    ids=["a file of the run", "a line in its log", "a file in .hydra"],
)
def test_a_folder_holding_anything_else_is_left_whole(tmp_path, other):
    run = hydra_made(tmp_path / "run")
    other(run)
    remove_unused_run_folder(run, tmp_path, ".hydra", "run.log")
    assert (run / ".hydra" / "config.yaml").is_file()


def test_a_samples_folder_goes_with_the_lines_it_said_and_its_resolved_config(tmp_path):
    run = hydra_made(tmp_path / "run")
    (run / "config.yaml").write_text("role: sample\n")
    (run / "run.log").write_text("sample: the data of the trained run\n")
    remove_unused_run_folder(run, tmp_path, ".hydra", "run.log")
    assert run.is_dir(), "a refused run's log holds no line"
    remove_unused_run_folder(run, tmp_path, ".hydra", "run.log", said_too=True)
    assert not run.exists()


def test_a_folder_that_existed_before_the_run_stays(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    kept = existing_ancestor(["hydra.run.dir=mine"])
    assert kept == tmp_path / "mine"
    remove_unused_run_folder(hydra_made(tmp_path / "mine"), kept, ".hydra", "run.log")
    assert (tmp_path / "mine" / ".hydra").is_dir()
    assert existing_ancestor(["hydra.run.dir=new/run"]) == tmp_path
    assert existing_ancestor([]) == tmp_path  # outputs/${now:...}: no outputs/ here yet


def run_py(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.slow  # two real python + hydra + torch starts (~3 s each)
def test_run_py_refuses_a_misspelled_key_in_one_line_and_a_bad_value_leaves_no_folder(tmp_path):
    result = run_py(f"hydra.run.dir={tmp_path}/typo", "trainer.max_step=100")
    assert result.returncode == 1 and result.stderr == (
        f"error: trainer.max_step is not a key; did you mean trainer.max_steps? {EVERY_KEY}\n"
    )
    result = run_py(f"hydra.run.dir={tmp_path}/new/run", "trainer.max_steps=-1")
    assert result.returncode == 1 and "trainer.max_steps=-1: must be a positive integer" in result.stderr
    assert list(tmp_path.iterdir()) == [], "the folders hydra made for the refused run are gone"


@pytest.mark.slow  # three real python + hydra + torch starts (~3 s each)
def test_a_run_refused_after_its_config_was_resolved_leaves_no_folder_either(tmp_path):
    """A missing data path, a missing eval checkpoint, a resume from nowhere: refused once config.yaml
    was written (before any process started), each takes its folder back."""
    for refused, said in [
        (["data=text", f"data.path={tmp_path}/nope"], "no such file or folder"),
        (["role=eval", f"checkpoint={tmp_path}/nope"], "does not exist"),
        ([f"trainer.resume={tmp_path}/nope"], "no such directory"),
    ]:
        result = run_py(f"hydra.run.dir={tmp_path}/outputs/run", *refused)
        assert result.returncode == 1 and said in result.stderr, result.stderr
        assert list(tmp_path.iterdir()) == [], (refused, list(tmp_path.rglob("*")))


@pytest.mark.slow  # a real python + hydra + torch start (~3 s)
def test_run_py_leaves_an_existing_run_folder_and_its_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    result = run_py(f"hydra.run.dir={tmp_path}", "trainer.max_steps=-1")
    assert result.returncode == 1 and (tmp_path / "notes.txt").read_text() == "mine\n"
