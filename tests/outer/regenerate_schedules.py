"""Writes tests/outer/golden_schedules.json: each round of a few whole jobs as ``OuterSync`` runs them.

Per round: the inner step s it launches after, the step s + τ it applies after, the fragment p it
syncs, the window length H in force (H₀ in a sync warm-up, T − E in a job's shorter last window), the mixing α(s, M = 2) and the outer
momentum μ warmed up to s: the warm-ups as ``scheduled`` cuts them to ``trainer.warmup_share``.
Run ``python -m tests.outer.regenerate_schedules`` after changing a schedule on purpose;
``test_golden_schedules.py`` fails until the file says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from diloco.config.job import JobConfig
from diloco.config.warmups import scheduled
from diloco.library.build import build_fragments
from diloco.outer.diloco_sync import Flight, OuterSync
from diloco.outer.round_plan import FixedPlan
from diloco.schedule import last_window
from diloco.train.sync_hooks import OuterOutcome
from tests.conftest import compose_job

GOLDEN = Path(__file__).with_name("golden_schedules.json")
REGENERATE = "python -m tests.outer.regenerate_schedules"
GROUPS = 2  # M: every round of the default job's two groups
CASES = {
    "diloco, 500 steps": [],
    "diloco, 5000 steps": ["trainer.max_steps=5000"],
    "streaming P=4 tau=1 H=100, 1000 steps": [
        *("model=mini", "algo=streaming", "algo.fragments=4", "algo.delay=1"),
        *("algo.sync_every=100", "trainer.max_steps=1000"),
    ],
    "sparseloco H=20, 500 steps": ["+experiment=sparseloco"],
    "streaming P=4 tau=3 H=100, 1234 steps (a last window of 34)": [
        *("model=mini", "algo=streaming", "algo.fragments=4", "algo.delay=3"),
        *("algo.sync_every=100", "trainer.max_steps=1234"),
    ],
}


class RoundRecorder(OuterSync):
    """``OuterSync`` deciding each step as in a job (``after_inner_step``), its rounds recorded, not run.

    Its fragments hold no parameters (a pipeline stage without a block of theirs), so it needs
    no model, lighthouse nor lane; α and μ come from the method the outer step reads them with.
    """

    def __init__(self, job: JobConfig) -> None:
        algo, outer_opt = scheduled(job)
        fragments = build_fragments(algo, outer_opt, nn.Module(), torch.device("cpu"), job.model.n_layers)
        super().__init__(
            algo=algo,
            fragments=fragments,
            plan=FixedPlan(algo),
            max_steps=job.trainer.max_steps,
            manager=None,
            heal_state=None,
            collective_timeout_s=0.0,
            end_wait_s=0.0,
            commit_log=None,
        )
        self.rounds: list[dict] = []

    def _launch(self, step: int, due: list[int]) -> None:
        self._flight = Flight(launch_step=step, fragments=[self.fragments[p] for p in due], deltas=[], weights=[])

    def _land(self, flight: Flight, step: int, outcome: OuterOutcome) -> None:
        H = self.algo.sync_every
        last = last_window(self.max_steps, H, self.warmup)
        if last is not None and step > last.start:
            H = last.end - last.start
        elif self.warmup is not None:
            H = self.warmup.window(step, H)
        for fragment in flight.fragments:
            alpha, mu = self._warmed_up(fragment, flight.launch_step, GROUPS)
            self.rounds.append(
                {
                    "launch": flight.launch_step,
                    "apply": step,
                    "fragment": fragment.index,
                    "H": H,
                    "alpha": round(alpha, 12),
                    "mu": None if mu is None else round(mu, 12),
                }
            )


def round_schedule(job: JobConfig) -> list[dict]:
    """Every round of ``job``, in the order its group applies them."""
    recorder = RoundRecorder(job)
    for step in range(1, job.trainer.max_steps + 1):
        recorder.after_inner_step(step, tokens=0)
    return recorder.rounds


def schedules() -> dict[str, dict]:
    return {name: {"overrides": o, "rounds": round_schedule(compose_job(o))} for name, o in CASES.items()}


def main() -> None:
    """One round a line, so a diff names the rounds that moved."""
    parts = []
    for name, case in schedules().items():
        rounds = ",\n".join(f"    {json.dumps(r)}" for r in case["rounds"])
        head = f'{json.dumps(name)}: {{"overrides": {json.dumps(case["overrides"])}'
        parts.append(f'  {head}, "rounds": [\n{rounds}\n  ]}}')
    GOLDEN.write_text("{\n" + ",\n".join(parts) + "\n}\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
