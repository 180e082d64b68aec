"""One replica group's outer rounds, without training, for ``test_lane_hang.py``: the real
manager, lighthouse client, lane watch and Gloo lanes; a one-number all-reduce per round.

Every group fails round 2 on purpose, so round 3 forms new lanes (a new quorum id); the group
given ``--stop-forming`` SIGSTOPs itself just before it joins that rendezvous. One JSON line
per round goes to ``--out``.

    python tests/ft/lane_hang_worker.py URL TOKEN GROUP --rounds N --out FILE [--stop-forming]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from diloco.ft.client import LighthouseClient  # noqa: E402
from diloco.ft.lane_watch import LaneWatcher  # noqa: E402
from diloco.ft.lanes import LaneError, Lanes, wait_work  # noqa: E402
from diloco.ft.manager import Manager  # noqa: E402

JOB, SIGNATURE = "lane-hang", "sig-lane-hang"
CONNECT_S = COLLECTIVE_S = 30.0  # far past the heartbeat timeout: waiting either out fails the test's bound
FAILED_ON_PURPOSE = 2


class TimedLanes(Lanes):
    """Lanes that note how long each ``ensure`` took, and (``stop_forming``) hang before a new one's rendezvous."""

    def __init__(self, stop_forming: bool) -> None:
        super().__init__(local_rank=0, connect_timeout_s=CONNECT_S, collective_timeout_s=COLLECTIVE_S)
        self.stop_forming = stop_forming
        self.seen: set[int] = set()
        self.took_s = 0.0

    def ensure(self, quorum_id, rank, size, store_address, follow=None):  # noqa: ANN001, ANN201
        began = time.monotonic()
        try:
            if self.stop_forming and self.seen and quorum_id not in self.seen:
                print(json.dumps({"stopping": time.time()}), flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            self.seen.add(quorum_id)
            return super().ensure(quorum_id, rank, size, store_address, follow)
        finally:
            self.took_s = time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("token")
    parser.add_argument("group")
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-forming", action="store_true")
    args = parser.parse_args()
    client = LighthouseClient(
        args.url, token=args.token, job_id=JOB, signature=SIGNATURE, group=args.group, connect_timeout_s=CONNECT_S
    )
    lanes = TimedLanes(args.stop_forming)
    manager = Manager(
        group=args.group,
        inner_pg=None,
        client=client,
        lanes=lanes,
        quorum_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        lane_watch=LaneWatcher(client, poll_s=60.0),
    )
    manager.start()
    with args.out.open("a") as out:
        for k in range(1, args.rounds + 1):
            began = time.monotonic()
            round_ = manager.start_round(k)
            record = {"round": k, "start_round_s": time.monotonic() - began, "lane_s": lanes.took_s}
            if round_ is not None:
                record["participants"] = list(round_.quorum.participants)
                value = torch.ones(1)
                try:
                    wait_work(round_.lane.allreduce([value]), COLLECTIVE_S, round_.stop_when())
                    ok = k != FAILED_ON_PURPOSE
                except LaneError as error:
                    record["lane_error"] = str(error)
                    ok = False
                record["sum"] = float(value.item())
                record["committed"] = manager.commit(round_, ok)
            out.write(json.dumps(record) + "\n")
            out.flush()
    manager.stop()


if __name__ == "__main__":
    main()
