"""The console progress line and the metrics file it is drawn from."""

from __future__ import annotations

import io
import json
from pathlib import Path

from diloco.launch.progress import (
    ProgressView,
    remaining_seconds,
    render_done,
    render_progress,
    render_starting,
)
from diloco.launch.supervisor import EventLog, event_line
from diloco.train.logger import MetricsLogger, read_jsonl, read_jsonl_tail


def test_render_progress_shows_step_bar_loss_throughput_and_eta():
    last = {"train/loss": 2.3456, "outer/round": 3.0}
    line = render_progress(50, 200, 30.0, last, eta_s=90.0, job_tokens_per_s=12345.0, width=8)
    assert line == "step 50/200 [##......] loss 2.346 round 3 tok/s 12.3k 0:30<1:30"
    assert render_progress(0, 200, 3.0, {}, width=8) == "step 0/200 [........] 0:03<?"
    line = render_progress(50, 200, 30.0, {}, eta_s=90.0, job_tokens_per_s=1e6, job_tflops=1.234, mfu=0.31, width=8)
    assert line == "step 50/200 [##......] tok/s 1000.0k TFLOP/s 1.23 MFU 31.0% 0:30<1:30"


def test_the_eta_comes_from_the_measured_step_rate_not_from_time_zero():
    """20 s of start-up, then 10 steps/s: at step 100 of 300 the rest takes 20 s (not 2 x 30 s)."""
    assert remaining_seconds((20.0, 10), (29.0, 100), 300) == 20.0
    assert remaining_seconds(None, (29.0, 100), 300) is None
    assert remaining_seconds((29.0, 100), (29.0, 100), 300) is None  # no rate yet
    assert remaining_seconds((20.0, 10), (50.0, 310), 300) == 0.0


def test_the_console_shows_the_whole_jobs_tokens_and_flops_per_second_and_the_mean_mfu(tmp_path):
    files = [tmp_path / "g0.jsonl", tmp_path / "g1.jsonl"]
    files[0].write_text(
        json.dumps({"step": 40, "train/tokens_per_s": 1000.0, "train/tflops": 0.5, "train/mfu": 0.2}) + "\n"
    )
    files[1].write_text(
        json.dumps({"step": 30, "train/tokens_per_s": 1500.0, "train/tflops": 0.75, "train/mfu": 0.3}) + "\n"
    )
    out = io.StringIO()
    view = ProgressView(files, max_steps=100, out=out, plain_interval_s=0.0)
    view.update(elapsed_s=10.0)
    assert "tok/s 2.5k TFLOP/s 1.25 MFU 25.0% 0:10<?" in out.getvalue()
    files[1].write_text(files[1].read_text() + json.dumps({"step": 50}) + "\n")
    view.update(elapsed_s=12.0)  # the slowest group went 30 -> 40 (group 0) in 2 s: 60 steps left at 5/s
    assert out.getvalue().splitlines()[-1].endswith("0:12<0:12")


def test_the_eval_loss_carries_the_step_it_was_measured_at_until_the_next_eval(tmp_path):
    """Repeated on every line after it, an eval loss says how old it is."""
    files = [tmp_path / "g0.jsonl"]
    records = [{"step": 50, "eval/loss": 1.9214}, {"step": 60, "train/loss": 1.8}, {"step": 70, "train/loss": 1.7}]
    files[0].write_text("".join(json.dumps(r) + "\n" for r in records))
    out = io.StringIO()
    ProgressView(files, max_steps=100, out=out, plain_interval_s=0.0).update(elapsed_s=10.0)
    assert "step 70/100 [#################.......] loss 1.700 eval 1.921@50 " in out.getvalue()


def test_metrics_file_is_read_incrementally_and_nan_becomes_null(tmp_path):
    path = tmp_path / "m" / "group0.jsonl"
    logger = MetricsLogger(path, wandb_run=None)
    logger.log({"train/loss": 3.0}, step=1)
    records, offset = read_jsonl_tail(path, 0)
    assert [r["train/loss"] for r in records] == [3.0]
    logger.log({"train/loss": float("nan")}, step=2)
    with path.open("a") as fh:
        fh.write('{"step": 3')  # a half-written line is left for the next read
    records, offset2 = read_jsonl_tail(path, offset)
    assert [r["step"] for r in records] == [2] and records[0]["train/loss"] is None
    assert offset2 > offset
    logger.close()


def test_progress_view_follows_the_slowest_group(tmp_path):
    files = [tmp_path / "g0.jsonl", tmp_path / "g1.jsonl"]
    files[0].write_text(json.dumps({"step": 40, "train/loss": 2.0}) + "\n")
    files[1].write_text(json.dumps({"step": 10, "train/loss": 4.0}) + "\n")
    out = io.StringIO()
    ProgressView(files, max_steps=100, out=out).update(elapsed_s=5.0)
    assert out.getvalue().startswith("step 10/100") and "loss 4.000" in out.getvalue()


def test_a_group_without_a_quorum_says_so_on_the_console(tmp_path):
    files = [tmp_path / "g0.jsonl", tmp_path / "g1.jsonl"]
    files[0].write_text(json.dumps({"step": 40, "outer/no_quorum_s": 0.0}) + "\n")
    files[1].write_text(json.dumps({"step": 40, "outer/no_quorum_s": 12.4}) + "\n")
    out = io.StringIO()
    ProgressView(files, max_steps=100, out=out).update(elapsed_s=5.0)
    assert out.getvalue().rstrip().endswith("| no quorum: group 1 for 12s")
    files[1].write_text(files[1].read_text() + json.dumps({"step": 50, "outer/no_quorum_s": 0.0}) + "\n")
    again = io.StringIO()
    ProgressView(files, max_steps=100, out=again).update(elapsed_s=6.0)
    assert "no quorum" not in again.getvalue()


def _append(path: Path, record: dict) -> None:
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def test_before_the_first_step_the_console_says_what_the_job_waits_for():
    assert render_starting(3.0, 2, 0, 0, 10) == "starting: workers importing torch and building the model (0:03)"
    assert render_starting(12.0, 2, 1, 0, 10) == "starting: 1 of 2 groups built their model (0:12)"
    assert render_starting(20.0, 2, 2, 0, 10) == (
        "starting: 2 of 2 groups built their model; waiting for the first quorum (0:20)"
    )
    assert render_starting(25.0, 2, 2, 1, 10) == "starting: 1 of 2 groups joined the first quorum (0:25)"
    assert render_starting(30.0, 2, 2, 2, 10) == "starting: training; a line every trainer.log_every=10 steps (0:30)"
    assert render_starting(30.0, 2, 2, None, 10) == "starting: training; a line every trainer.log_every=10 steps (0:30)"


def test_the_starting_line_follows_the_run_directory_every_ten_seconds(tmp_path):
    """A leader opens its metrics file once its model is built; its first commit record is its
    join; until a step is logged a plain console gets a line every 10 s, each with its time."""
    metrics = [tmp_path / "m0.jsonl", tmp_path / "m1.jsonl"]
    commits = [tmp_path / "c0.jsonl", tmp_path / "c1.jsonl"]
    out = io.StringIO()
    view = ProgressView(metrics, max_steps=100, out=out, commits=commits)
    view.update(elapsed_s=2.0)
    view.update(elapsed_s=5.0)  # nothing new is said before 10 s have passed
    for path in metrics:
        path.touch()
    view.update(elapsed_s=12.0)
    _append(commits[0], {"round": 0, "join": True})
    view.update(elapsed_s=22.0)
    assert out.getvalue().splitlines() == [
        "starting: workers importing torch and building the model (0:02)",
        "starting: 2 of 2 groups built their model; waiting for the first quorum (0:12)",
        "starting: 1 of 2 groups joined the first quorum (0:22)",
    ]


def test_a_step_that_does_not_change_is_repeated_every_30_s_saying_for_how_long_nothing_was_logged(tmp_path):
    """A slow model logs every 10 steps: its line is not reprinted every 10 s as if new, and it
    has an ETA from its first logged steps' own time per step."""
    files = [tmp_path / "g0.jsonl"]
    _append(files[0], {"step": 10, "train/step_ms": 4000.0})
    out = io.StringIO()
    view = ProgressView(files, max_steps=100, out=out)
    for elapsed in range(100, 141, 5):
        view.update(elapsed_s=float(elapsed))
    assert out.getvalue().splitlines() == [
        "step 10/100 [##......................] 1:40<6:00",  # 90 steps at 4 s
        "step 10/100 [##......................] 2:10<5:30 | nothing logged for 0:30 (trainer.log_every=10 steps)",
    ]
    _append(files[0], {"step": 20, "train/step_ms": 4000.0})
    view.update(elapsed_s=150.0)  # now measured: 10 steps in 50 s
    assert out.getvalue().splitlines()[-1] == "step 20/100 [#####...................] 2:30<6:40"


def test_the_last_line_shows_the_jobs_average_rate_as_the_done_line_and_summary_do(tmp_path):
    """While training the line sums the groups' last logged rates; the last one, drawn once
    summary.json is written, has its tokens_per_s, TFLOP/s and MFU scaled alike, and the line
    the loop would print at the last step is left to it."""
    files = [tmp_path / "g0.jsonl", tmp_path / "g1.jsonl"]
    for path in files:
        _append(path, {"step": 100, "train/tokens_per_s": 20_000.0, "train/tflops": 0.02, "train/mfu": 0.1})
    out = io.StringIO()
    view = ProgressView(files, max_steps=100, out=out)
    view.update(elapsed_s=80.0)
    assert out.getvalue() == ""
    view.finish(elapsed_s=82.0, job_tokens_per_s=24_500.0)
    assert out.getvalue() == "step 100/100 [########################] tok/s 24.5k TFLOP/s 0.0245 MFU 6.1% 1:22<0:00\n"


def test_on_a_terminal_the_line_is_redrawn_in_place_and_an_event_line_clears_it_first(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    files = [tmp_path / "g0.jsonl"]
    _append(files[0], {"step": 10})
    out = Terminal()
    view = ProgressView(files, max_steps=100, out=out)
    view.update(elapsed_s=10.0)
    EventLog(tmp_path / "events.jsonl", 0.0, out).write("kill", 0)
    assert out.getvalue().startswith("\r\x1b[Kstep 10/100 ")
    assert "\r\x1b[Kfault: kill group 0 (SIGKILL) at " in out.getvalue()


SUMMARY = {
    "ok": True,
    "algo": "diloco",
    "final_eval_loss": 1.531,
    "final_eval_ppl": 4.62,
    "tokens_seen": 2_048_000,
    "wall_seconds": 95.2,
    "train_seconds": 83.6,
    "tokens_per_s": 24_497.0,
    "rounds": 18,
    "syncs_committed": 35,
    "syncs_attempted": 36,
    "faults": {"kill": 2, "hang": 1, "plan": 3, "restart": 2, "resume": 1, "skipped": 1},
    "recoveries": 2,
    "lost_work": {"global_step": 500, "max_steps": 500, "steps_short": 0, "per_group": {"0": 0}, "group_steps_lost": 0},
}


def test_the_done_line_counts_tokens_rate_rounds_faults_restarts_and_heals():
    path = Path("/run/summary.json")
    assert render_done(SUMMARY, path) == (
        "done: eval loss 1.5310 (ppl 4.62); 2,048,000 tokens in 95s (24.5k tok/s over 84s of training); "
        "18 rounds, 35/36 syncs committed; faults: 2 kill, 1 hang; 2 restarts, 2 heals from a peer; summary in "
        "/run/summary.json"
    )
    calm = SUMMARY | {"ok": False, "algo": "local", "faults": {}, "recoveries": 1}
    assert render_done(calm, path) == (
        "failed: eval loss 1.5310 (ppl 4.62); 2,048,000 tokens in 95s (24.5k tok/s over 84s of training); "
        "faults: 1 heal from a peer; summary in /run/summary.json"
    )
    assert "; no faults; summary in " in render_done(calm | {"recoveries": 0}, path)
    multihost = calm | {"faults": {"restart": 1}}  # torchrun's restart, seen in the commit logs
    assert "; faults: 1 restart, 1 heal from a peer; summary in " in render_done(multihost, path)


def test_the_done_line_says_why_the_groups_trained_fewer_tokens_than_planned():
    """A restarted group heals to the job's step: the steps it was down are trained by no one."""
    short = SUMMARY | {"tokens_seen": 1_228_800, "tokens_planned": 2_048_000}
    assert "; 1,228,800 of the 2,048,000 planned tokens (a group that heals goes on from the job's step: the " in (
        render_done(short, Path("/run/summary.json"))
    )
    assert "; 1,228,800 of the 2,048,000 planned tokens in 95s (" in render_done(short | {"recoveries": 0}, Path("/s"))
    assert "; 2,048,000 tokens in 95s" in render_done(SUMMARY | {"tokens_planned": 2_048_000}, Path("/s"))


def test_the_done_line_says_in_words_what_never_reached_the_global_model_instead_of_no_faults():
    path = Path("/run/summary.json")
    apart = {"global_step": 360, "max_steps": 1500, "steps_short": 1140, "per_group": {"0": 0, "1": 1140, "2": 1140}}
    calm = SUMMARY | {"faults": {}, "recoveries": 0, "rounds": 33, "syncs_committed": 97, "syncs_attempted": 101}
    assert render_done(calm | {"lost_work": apart | {"group_steps_lost": 2280}}, path) == (
        "done: eval loss 1.5310 (ppl 4.62); 2,048,000 tokens in 95s (24.5k tok/s over 84s of training); "
        "33 rounds, 97/101 syncs committed; work lost: the model is the global state of step 360 of 1,500, "
        "and 2,280 group-steps trained never reached it (group 1: 1,140, group 2: 1,140); no other faults; "
        "summary in /run/summary.json"
    )
    failed_round = {"global_step": 500, "max_steps": 500, "steps_short": 0, "per_group": {"0": 30, "1": 0}}
    assert "; work lost: 30 group-steps trained never reached the global model (group 0: 30); faults: 2 kill, " in (
        render_done(SUMMARY | {"lost_work": failed_round | {"group_steps_lost": 30}}, path)
    )
    short = apart | {"per_group": {"0": 0}, "group_steps_lost": 0}
    assert "; work lost: the model is the global state of step 360 of 1,500; no other faults; summary " in (
        render_done(calm | {"lost_work": short}, path)
    )


def test_each_event_is_one_plain_console_line_and_one_record(tmp_path):
    out = io.StringIO()
    events = EventLog(tmp_path / "events.jsonl", 0.0, out)
    events.write("kill", 1)
    assert read_jsonl(tmp_path / "events.jsonl")[0]["kind"] == "kill"
    assert out.getvalue().startswith("fault: kill group 1 (SIGKILL) at ") and out.getvalue().count("\n") == 1
    assert event_line({"kind": "restart", "group": 1, "elapsed": 16.2}) == "restart: group 1 at 0:16"
    assert event_line({"kind": "restart", "group": 1, "spare": 0, "elapsed": 16.2}) == (
        "restart: group 1 on warm spare 0 at 0:16"
    )
    crash = {"kind": "crash", "group": 0, "rank": 1, "code": -9, "in_a_row": 1, "max_restarts": 3, "elapsed": 75.0}
    assert event_line(crash) == (
        "crash: group 0 rank 1 exited with code -9 (1 in a row; more than cluster.max_restarts=3 fail the job) at 1:15"
    )
    wait = {"kind": "plan", "group": 2, "choice": "wait", "ready_s": 7.6, "elapsed": 5.0}
    assert event_line(wait) == "plan: the others wait for group 2 (ready in ~8s) at 0:05"
    assert event_line({"kind": "lighthouse_down", "group": None, "elapsed": 0.0}) == "fault: lighthouse killed at 0:00"
    assert (
        event_line({"kind": "crash", "group": 1, "elapsed": 1.0}) == "crash: group 1 rank ? exited with code ? at 0:01"
    )
