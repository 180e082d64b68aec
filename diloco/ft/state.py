"""The live state a behind group receives from a peer: named tensors of this worker's shard.

θ_g of every fragment, every fragment's outer-optimizer state, the inner optimizer's state,
and as JSON where the sender stood (``Position``). Received tensors are staged and
copied into the live ones only once the whole group has them (docs/design.md, invariant 2).
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch
import torch.distributed as dist

from diloco.ft.lanes import CancelScope
from diloco.ft.transport import StateBundle, TransferError, recv_state, send_state
from outer_opt import load_optimizer_state_tensors, optimizer_state_tensors

log = logging.getLogger(__name__)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (FSDP2, tensor parallelism), without importing DTensor where nothing shards:
    its module (with sympy) costs the launcher, the lighthouse and every ``python run.py`` 0.9 s,
    and no tensor can be a DTensor before that module is loaded."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This worker's shard of a (possibly FSDP- or tensor-parallel-sharded) tensor, sharing its storage."""
    return t.to_local() if is_dtensor(t) else t


def counted_here(t: torch.Tensor) -> bool:
    """Whether this worker counts its shard of ``t`` in a sum over the group's workers: a tensor
    replicated over a mesh dimension (tensor parallelism's norms) is counted by that dimension's
    rank 0 only, so each entry of the model is counted once."""
    if not is_dtensor(t):
        return True
    coordinate = t.device_mesh.get_coordinate()
    return all(c == 0 for placement, c in zip(t.placements, coordinate, strict=True) if placement.is_replicate())


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a group stands when it sends its state: what the receiver takes over.

    ``round_step`` is the inner step the round that carries the transfer was launched at:
    with overlap (τ > 0) the sender serves at the round's apply step, ``inner_step`` =
    ``round_step`` + τ, and the receiver joins the reduce of the fragments launched then.
    """

    committed: int
    inner_step: int
    round_step: int


class HealState:
    """Collects the state to send, and applies a received one, for one worker."""

    def __init__(
        self,
        *,
        global_params: list[list[torch.Tensor]],
        outer_optimizers: list[torch.optim.Optimizer],
        inner_optimizer: torch.optim.Optimizer,
        extra: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``extra``: small tensors of the job's state besides the model's (``algo.auto``'s plan)."""
        self.global_params = global_params
        self.outer_optimizers = outer_optimizers
        self.inner_optimizer = inner_optimizer
        self.extra = extra or {}

    def global_tensors(self) -> dict[str, torch.Tensor]:
        """θ_g and outer-optimizer state: what docs/design.md, invariant 1 says must match across groups."""
        named: dict[str, torch.Tensor] = {}
        for p in range(len(self.global_params)):
            named.update(self.fragment_tensors(p))
        return named

    def fragment_tensors(self, p: int) -> dict[str, torch.Tensor]:
        """Fragment p's part of ``global_tensors``: its θ_g and its outer optimizer's state."""
        named = {f"global.{p}.{i}": t.detach() for i, t in enumerate(self.global_params[p])}
        if self.outer_optimizers:
            named.update({f"outer.{p}.{k}": v for k, v in optimizer_state_tensors(self.outer_optimizers[p]).items()})
        return named

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.global_tensors() | inner_optimizer_tensors(self.inner_optimizer) | self.extra

    def send(
        self, lane: dist.ProcessGroup, dst: int, position: Position, timeout_s: float, cancel: CancelScope | None = None
    ) -> bool:
        """Send our state to lane rank ``dst``; False if the transfer failed or was cancelled."""
        bundle = StateBundle(
            tensors={k: v.detach().cpu() for k, v in self.tensors().items()},
            meta=dataclasses.asdict(position),
        )
        try:
            send_state(lane, dst, bundle, timeout_s, cancel)
        except TransferError as error:
            log.warning("sending state to lane rank %d failed: %s", dst, error)
            return False
        return True

    def receive(
        self, lane: dist.ProcessGroup, src: int, timeout_s: float, cancel: CancelScope | None = None
    ) -> StateBundle | None:
        created = create_state_to_fill(self.inner_optimizer)
        template = {k: v.detach().cpu() if v.device.type != "cpu" else v for k, v in self.tensors().items()}
        try:
            return recv_state(lane, src, template, timeout_s, cancel=cancel)
        except TransferError as error:
            log.warning("receiving state from lane rank %d failed: %s", src, error)
            if created:  # left as it was: never stepped
                self.inner_optimizer.state.clear()
            return None

    def apply(self, bundle: StateBundle) -> Position:
        """Copy a received state into the live tensors; returns where the sender stood."""
        self.load_tensors(bundle.tensors)
        return Position(**{f.name: int(bundle.meta[f.name]) for f in dataclasses.fields(Position)})

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (named as ``tensors()`` names them) into the live state."""
        live = self.tensors()
        for name, tensor in tensors.items():
            if not name.startswith("outer."):
                live[name].copy_(tensor)
        for p, opt in enumerate(self.outer_optimizers):
            prefix = f"outer.{p}."
            load_optimizer_state_tensors(opt, {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})


@torch.no_grad()
def create_state_to_fill(optimizer: torch.optim.Optimizer) -> bool:
    """Give an optimizer that never stepped its per-parameter state, so a heal has tensors of the
    peer's names and shapes to receive into; True if it made them.

    Optimizers create their state at their first step: this takes one on zero gradients and puts
    the parameters back. The values it leaves do not matter, the peer's replace every one (a job's
    AdamW has its state from the start: ``diloco.train.inner_opt.init_adamw_state``).
    """
    params = _params(optimizer)
    if any(optimizer.state.get(p) for p in params):
        return False
    saved = [(p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, (value, grad) in zip(params, saved, strict=True):
        p.copy_(value)
        p.grad = grad
    return True


def inner_optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The inner optimizer's per-parameter tensor state (this worker's shard), by reference."""
    named = {}
    for i, param in enumerate(_params(optimizer)):
        for key, value in optimizer.state[param].items():
            if isinstance(value, torch.Tensor):
                named[f"inner.{i}.{key}"] = local_tensor(value)
    return named


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
