"""What a group reports for the lighthouse's status page: the trainer's figures through
``Synchronizer.observe``, evaluations included, and the step a heal jumps it to."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import torch

from diloco.ft.protocol import GroupProgress
from diloco.ft.state import Position
from diloco.outer.synchronizer import Synchronizer
from diloco.train.model import Transformer
from diloco.train.sync_hooks import NoSync
from diloco.worker.builders import build_trainer
from tests.conftest import compose_job


class ProgressManager:
    """The part of ``Manager`` a synchronizer reports progress and heals through, with
    ``note_progress``'s rule: only the fields given change."""

    group = "A"
    committed = 0

    def __init__(self) -> None:
        self.progress = GroupProgress()

    def note_progress(self, **changes: Any) -> None:
        self.progress = dataclasses.replace(self.progress, **changes)

    def all_ranks(self, value: bool) -> bool:
        return value

    def adopt(self, committed: int) -> None:
        self.committed = committed


def _synchronizer(heal_state: Any = None) -> Synchronizer:
    return Synchronizer(
        manager=ProgressManager(), heal_state=heal_state, collective_timeout_s=1.0, end_wait_s=1.0, commit_log=None
    )


def _reported(sync: Synchronizer) -> GroupProgress:
    """What the lighthouse reads of the group's next sign of life."""
    return GroupProgress.from_json(sync.manager.progress.to_json())


def test_an_evaluation_reports_its_loss_and_step_and_keeps_the_train_figures():
    sync = _synchronizer()
    sync.observe(100, {"train/loss": 3.0, "train/tokens_per_s": 50.0})
    sync.observe(100, {"eval/loss": 3.25})
    assert _reported(sync) == GroupProgress(
        inner_step=100, train_loss=3.0, tokens_per_s=50.0, eval_loss=3.25, eval_step=100
    )
    sync.observe(110, {"train/loss": math.nan, "train/tokens_per_s": 60.0})
    assert _reported(sync) == GroupProgress(inner_step=110, tokens_per_s=60.0, eval_loss=3.25, eval_step=100)
    sync.observe(200, {"eval/loss": math.inf})
    assert _reported(sync) == GroupProgress(inner_step=200, tokens_per_s=60.0), "a diverged evaluation: no eval point"


def test_a_group_that_heals_reports_the_step_it_healed_to():
    """A restarted process that healed straight to the end never logged a step: its page read inner step 0."""
    healed = Position(committed=5, inner_step=1000, round_step=1000)
    heal_state = SimpleNamespace(receive=lambda *args: "staged", apply=lambda staged: healed)
    sync = _synchronizer(heal_state)
    sync.observe(40, {"train/loss": 3.5, "train/tokens_per_s": 50.0})
    round_ = SimpleNamespace(heal_targets=(), heal_source="B", lane=None, stop_when=lambda group: None)
    assert sync._heal_and_serve(round_, 40, 40) == (True, healed)
    assert _reported(sync) == GroupProgress(inner_step=1000, tokens_per_s=50.0), "the loss was of the state replaced"
    assert sync.manager.committed == 5 and sync.recoveries == 1


class Observed(NoSync):
    """No outer rounds; what the trainer hands ``observe``, kept."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[str]]] = []

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        self.seen.append((step, sorted(metrics)))


def test_the_trainer_reports_each_evaluation_to_its_synchronizer():
    job = compose_job(
        ["algo=local", "trainer.max_steps=6", "trainer.log_every=4", "trainer.eval_every=3", "trainer.eval_batches=1"]
        + ["trainer.seq_len=32", "trainer.batch_size=2"]
    )
    torch.manual_seed(job.trainer.seed)
    trainer = build_trainer(job, Transformer(job.model), group=0, worker=0, num_workers=1, device=torch.device("cpu"))
    trainer.outer = observed = Observed()
    trainer.fit()
    assert [(step, keys) for step, keys in observed.seen if "eval/loss" in keys] == [(3, ["eval/loss"])]
    assert [step for step, keys in observed.seen if "train/loss" in keys] == [4, 6]
