"""Warm spares: the assignment pipes (real named pipes and reader threads) and the supervisor's
rules for taking a spare and refilling the pool (a real LocalCluster with stand-in processes)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from diloco.launch.local_cluster import JobFailed, LocalCluster, Spare, WorkerProcess, wait_until
from diloco.launch.supervisor import Supervisor
from diloco.run_paths import RunPaths
from diloco.train.logger import read_jsonl
from diloco.worker.spares import Assignment, SpareAssignmentError, assign, make_pipes, wait_for_assignment
from tests.stand_ins import exited, running, supervise, worker


def read_in_background(pipe: Path) -> Future:
    done: Future = Future()

    def target() -> None:
        try:
            done.set_result(wait_for_assignment(pipe))
        except BaseException as error:  # noqa: BLE001 - handed to the test
            done.set_exception(error)

    threading.Thread(target=target, daemon=True).start()
    return done


def test_an_assignment_reaches_every_waiting_rank(tmp_path):
    pipes = make_pipes(RunPaths(tmp_path), spare=3, ranks=2)
    readers = [read_in_background(p) for p in pipes]
    sent = Assignment(group=1, started_at=12.5)
    wait_until(lambda: assign(pipes, sent), 10.0, "both ranks to wait", poll_s=0.01)
    assert [r.result(timeout=10) for r in readers] == [sent, sent]


def test_a_spare_with_a_rank_still_building_gets_nothing_and_its_ready_rank_waits_on(tmp_path):
    pipes = make_pipes(RunPaths(tmp_path), spare=0, ranks=2)
    ready = read_in_background(pipes[0])  # rank 1 is still building: no reader on its pipe
    wait_until(lambda: has_reader(pipes[0]), 10.0, "rank 0 to wait", poll_s=0.01)
    for _ in range(20):  # whenever rank 0 opens its end, the spare is not whole: never assigned
        assert not assign(pipes, Assignment(0, 0.0))
    assert not ready.done()
    late = read_in_background(pipes[1])
    wait_until(lambda: assign(pipes, Assignment(0, 1.0)), 10.0, "both ranks to wait", poll_s=0.01)
    assert ready.result(timeout=10) == late.result(timeout=10) == Assignment(0, 1.0)


def test_a_waiting_rank_never_lets_go_of_its_pipe(tmp_path):
    """Regression (a CI run): a rank that re-opened its pipe after each open closed unwritten had
    moments with no read end open; an assignment written just before such a moment was dropped
    with the pipe's buffer, and the rank waited for good. Now it holds the pipe from the moment
    it is built until it reads its assignment: opens closed unwritten never find it gone."""
    [pipe] = make_pipes(RunPaths(tmp_path), spare=0, ranks=1)
    got = read_in_background(pipe)
    wait_until(lambda: has_reader(pipe), 10.0, "the rank to wait", poll_s=0.001)
    assert all(has_reader(pipe) for _ in range(2000)), "the rank let go of its pipe between two opens"
    assert assign([pipe], Assignment(0, 1.0))
    assert got.result(timeout=5) == Assignment(0, 1.0)


def test_nobody_waiting_means_no_assignment_and_no_block(tmp_path):
    pipes = make_pipes(RunPaths(tmp_path), spare=0, ranks=1)
    assert not assign(pipes, Assignment(0, 0.0))
    assert not assign([tmp_path / "gone.fifo"], Assignment(0, 0.0))


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b'{"group": -1, "started_at": 0}',
        b'{"group": "1", "started_at": 0}',
        b'{"group": 1}',
        b'{"group": true, "started_at": 0}',
        b'{"group": 1, "started_at": "now"}',
        b"[1, 2]",
    ],
)
def test_anything_but_an_assignment_is_refused(raw):
    with pytest.raises(SpareAssignmentError, match="not a spare assignment"):
        Assignment.decode(raw)


def test_a_plain_file_is_not_a_spare_pipe(tmp_path):
    path = tmp_path / "spare0_rank0.fifo"
    path.write_text('{"group": 0, "started_at": 0}')
    with pytest.raises(SpareAssignmentError, match="not the named pipe"):
        wait_for_assignment(path)


# The supervisor, over stand-in processes: a spare's "worker" is a shell that keeps reading its pipe.


SPARE_STAND_IN = """
import sys, time
from pathlib import Path
from diloco.worker.spares import wait_for_assignment
pipe = Path(sys.argv[1])
Path(f"{pipe}.got").write_text(str(wait_for_assignment(pipe).group))
time.sleep(60)
"""


def stand_in_spare(cluster: LocalCluster, index: int) -> Spare:
    """A process that waits on its pipe as a built spare's worker does, and notes the group it got."""
    pipe = make_pipes(cluster.paths, index, 1)[0]
    reader = subprocess.Popen([sys.executable, "-c", SPARE_STAND_IN, str(pipe)])
    return Spare(index, [WorkerProcess(None, 0, reader, Path("/dev/null"))], [pipe])


def has_reader(pipe: Path) -> bool:
    """Whether a rank waits on ``pipe`` (opening and closing it unwritten: that rank just waits again)."""
    try:
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        return False
    return True


def supervise_spares(tmp_path: Path, spares: int, backoff_s: float = 60.0, max_restarts: int = 1) -> Supervisor:
    """Groups 0 and 2 run, group 1 was killed on purpose; a spare started is a stand-in waiting on its pipe."""
    supervisor = supervise(
        tmp_path, {0: running(), 2: running()}, max_restarts=max_restarts, backoff_s=backoff_s, spares=spares
    )
    cluster = supervisor.cluster
    indexes = itertools.count()  # numbered in start order and never reused, as LocalCluster numbers its own

    def start_spare() -> Spare:
        cluster.spares.append(stand_in_spare(cluster, next(indexes)))
        return cluster.spares[-1]

    cluster.start_spare = start_spare
    return supervisor


def kinds(supervisor: Supervisor) -> list[tuple]:
    return [(e["kind"], e["group"], e.get("spare")) for e in read_jsonl(supervisor.cluster.paths.events)]


def test_a_ready_spare_replaces_a_killed_group_at_once_and_the_pool_is_refilled(tmp_path):
    supervisor = supervise_spares(tmp_path, spares=1)
    cluster = supervisor.cluster
    try:
        cluster.groups[1] = [worker(1, running())]
        supervisor.check(now=0.0)  # the pool is filled at the first check
        assert [s.index for s in cluster.spares] == [0] and not cluster.started
        spare_pid = cluster.spares[0].workers[0].process.pid
        wait_until(lambda: has_reader(cluster.spares[0].pipes[0]), 10.0, "the spare to be ready", poll_s=0.01)
        cluster.signal_group(1, 9)
        supervisor.check(now=1.0)
        assert cluster.groups[1][0].process.pid == spare_pid and not cluster.started, "no backoff, no fresh start"
        assert kinds(supervisor) == [("plan", 1, None), ("restart", 1, 0)]
        assert read_jsonl(supervisor.cluster.paths.events)[0]["replacement"] == "spare"
        assert [s.index for s in cluster.spares] == [1], "refilled at once"
        got = Path(f"{cluster.paths.spare_pipe(0, 0)}.got")
        wait_until(got.exists, 10.0, "the spare to note its group", poll_s=0.01)
        assert got.read_text() == "1"
    finally:
        cluster.stop()


def test_without_a_ready_spare_a_group_is_restarted_fresh_after_no_wait(tmp_path):
    """Spares kept but none built yet (no reader on its pipe): fresh workers at once."""
    supervisor = supervise_spares(tmp_path, spares=1)
    cluster = supervisor.cluster
    cluster.start_spare = lambda: cluster.spares.append(Spare(0, [], make_pipes(cluster.paths, 0, 1)))
    try:
        supervisor.check(now=0.0)
        assert cluster.started == [1] and kinds(supervisor) == [("plan", 1, None), ("restart", 1, None)]
    finally:
        cluster.stop()


def test_without_spares_the_backoff_still_holds(tmp_path):
    supervisor = supervise_spares(tmp_path, spares=0, backoff_s=5.0)
    cluster = supervisor.cluster
    try:
        supervisor.check(now=0.0)
        assert not cluster.started and not cluster.spares
        supervisor.check(now=5.0)
        assert cluster.started == [1]
    finally:
        cluster.stop()


def test_a_crash_loop_waits_its_backoff_even_with_spares(tmp_path):
    """A group whose processes never held the job's state crashed twice in a row: a bug, not a
    fault; a spare would crash as well, so it waits as it would without spares."""
    supervisor = supervise_spares(tmp_path, spares=1, backoff_s=5.0, max_restarts=3)
    cluster = supervisor.cluster
    try:
        supervisor.crashes[1] = 1
        cluster.groups[1] = [worker(1, exited(1))]
        supervisor.check(now=0.0)
        assert supervisor.crashes[1] == 2 and supervisor.restart_at[1] == pytest.approx(10.0)
    finally:
        cluster.stop()


def test_spares_that_keep_dying_fail_the_job_with_their_log(tmp_path):
    supervisor = supervise_spares(tmp_path, spares=1, max_restarts=1)
    cluster = supervisor.cluster
    log = tmp_path / "spare.log"
    log.write_text("Traceback: the spare could not build its model\n")

    def start_dying_spare() -> Spare:
        cluster.spares.append(Spare(len(cluster.spares), [WorkerProcess(None, 0, exited(1), log)], []))
        return cluster.spares[-1]

    cluster.start_spare = start_dying_spare
    cluster.groups[1] = [worker(1, running())]
    try:
        supervisor.check(now=0.0)
        supervisor.check(now=0.1)  # the first died: replaced
        with pytest.raises(JobFailed, match="warm spares failed 2 times in a row(.|\n)*could not build its model"):
            supervisor.check(now=0.2)
        assert [k for k, _, _ in kinds(supervisor)] == ["spare_crash", "spare_crash"]
    finally:
        cluster.stop()


def test_spares_are_stopped_once_the_job_is_over(tmp_path):
    supervisor = supervise_spares(tmp_path, spares=1)
    cluster = supervisor.cluster
    try:
        cluster.groups[1] = [worker(1, running())]
        supervisor.check(now=0.0)
        spare = cluster.spares[0]
        supervisor.end_seen = True
        supervisor.check(now=1.0)
        assert not cluster.spares and spare.workers[0].process.poll() is not None
    finally:
        cluster.stop()
