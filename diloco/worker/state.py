"""A worker's whole state for a checkpoint: what it saves at a planned stop and restores on resume.

Tensors (this worker's shard, by reference): θ_l (``model.*``), the inner optimizer's state
(``inner.*``) and, with a synchronizer, θ_g and the outer optimizers' state (``global.*``,
``outer.*``, named as a heal names them) plus the group's own outer state (``error.*``:
algo.compress's e). Progress (JSON): the trainer's step and data position, the
synchronizer's committed round and counters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.ft.state import inner_optimizer_tensors, local_tensor
from diloco.outer.synchronizer import Synchronizer
from diloco.train.checkpoint import CheckpointError, group_dir, load_rank, mark_complete, rank_dir, save_rank, step_dir
from diloco.train.trainer import Trainer


class WorkerState:
    """Saves and restores one worker's part of its group's state (see the module docstring)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer: Synchronizer | None,
        rank: int,
        identity: dict[str, Any],
    ) -> None:
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.outer = outer
        self.rank = rank
        self.identity = identity  # what a resumed job must share with the one that saved (check_compatible)

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {f"model.{name}": local_tensor(p).detach() for name, p in self.model.named_parameters()}
        if self.outer is not None:
            return named | self.outer.checkpoint_tensors()
        return named | inner_optimizer_tensors(self.inner_optimizer)

    def progress(self, trainer: Trainer) -> dict[str, Any]:
        progress = {"trainer": trainer.progress_state()}
        if self.outer is not None:
            progress["outer"] = self.outer.progress_state()
        return progress

    def save(self, trainer: Trainer, run_dir: Path, group: int) -> Path:
        """Write this worker's shard under ``checkpoints/step-N`` (a collective over the group's ranks)."""
        step = trainer.step
        folder = group_dir(step_dir(run_dir, step), group)
        problem = None
        try:
            save_rank(rank_dir(folder, self.rank), self.tensors(), self.progress(trainer))
        except OSError as error:
            problem = error
        if not _every_rank(problem is None):
            raise CheckpointError(f"{folder}: a worker of group {group} could not write its shard ({problem})")
        if self.rank == 0:
            committed = self.outer.manager.committed if self.outer is not None else 0
            mark_complete(folder, self.identity | {"step": step, "committed": committed})
        return folder

    @torch.no_grad()
    def restore(self, trainer: Trainer, folder: Path) -> None:
        """Load this worker's shard from a group's checkpoint folder; nothing live changes if it is refused."""
        loaded, progress = load_rank(rank_dir(folder, self.rank), self.tensors())
        model = {k: v for k, v in loaded.items() if k.startswith("model.")}
        live = self.tensors()
        for name, tensor in model.items():
            live[name].copy_(tensor)
        rest = {k: v for k, v in loaded.items() if not k.startswith("model.")}
        if self.outer is not None:
            self.outer.load_checkpoint_tensors(rest)
            self.outer.load_progress_state(progress["outer"])
        else:
            for name, tensor in rest.items():
                live[name].copy_(tensor)
        trainer.load_progress_state(progress["trainer"])


def _every_rank(ok: bool) -> bool:
    """True only if ``ok`` on every rank of the group (CPU tensors go through Gloo on any backend)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
