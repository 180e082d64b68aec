"""The console progress line and the metrics file it is drawn from."""

from __future__ import annotations

import io
import json

from diloco.launch.progress import ProgressView, remaining_seconds, render_progress
from diloco.train.logger import MetricsLogger, read_jsonl_tail


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
