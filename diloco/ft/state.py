"""The live state a behind group receives from a peer: named tensors of this worker's shard.

θ_g of every fragment, every fragment's outer-optimizer state, the inner optimizer's state,
and as JSON the committed round count and the inner step. Received tensors are staged and
copied into the live ones only once the whole group has them (DESIGN invariant 2).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from diloco.ft.transport import StateBundle, TransferError, recv_state, send_state
from outer_opt import load_optimizer_state_tensors, optimizer_state_tensors

log = logging.getLogger(__name__)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This worker's shard of a (possibly FSDP-sharded) tensor, sharing its storage."""
    return t.to_local() if isinstance(t, DTensor) else t


class HealState:
    """Collects the state to send, and applies a received one, for one worker."""

    def __init__(
        self,
        *,
        global_params: list[list[torch.Tensor]],
        outer_optimizers: list[torch.optim.Optimizer],
        inner_optimizer: torch.optim.Optimizer,
    ) -> None:
        self.global_params = global_params
        self.outer_optimizers = outer_optimizers
        self.inner_optimizer = inner_optimizer

    def global_tensors(self) -> dict[str, torch.Tensor]:
        """θ_g and outer-optimizer state: what invariant 1 says must match across groups."""
        named: dict[str, torch.Tensor] = {}
        for p, params in enumerate(self.global_params):
            named.update({f"global.{p}.{i}": t.detach() for i, t in enumerate(params)})
        for p, opt in enumerate(self.outer_optimizers):
            named.update({f"outer.{p}.{k}": v for k, v in optimizer_state_tensors(opt).items()})
        return named

    def tensors(self) -> dict[str, torch.Tensor]:
        named = self.global_tensors()
        for i, param in enumerate(_params(self.inner_optimizer)):
            for key, value in self.inner_optimizer.state[param].items():
                if isinstance(value, torch.Tensor):
                    named[f"inner.{i}.{key}"] = local_tensor(value)
        return named

    def send(self, lane: dist.ProcessGroup, dst: int, committed: int, inner_step: int, timeout_s: float) -> bool:
        """Send our state to lane rank ``dst``; False if the transfer failed (the receiver retries later)."""
        bundle = StateBundle(
            tensors={k: v.detach().cpu() for k, v in self.tensors().items()},
            meta={"committed": committed, "inner_step": inner_step},
        )
        try:
            send_state(lane, dst, bundle, timeout_s)
        except TransferError as error:
            log.warning("sending state to lane rank %d failed: %s", dst, error)
            return False
        return True

    def receive(self, lane: dist.ProcessGroup, src: int, timeout_s: float) -> StateBundle | None:
        template = {k: v.detach().cpu() if v.device.type != "cpu" else v for k, v in self.tensors().items()}
        try:
            return recv_state(lane, src, template, timeout_s)
        except TransferError as error:
            log.warning("receiving state from lane rank %d failed: %s", src, error)
            return None

    @torch.no_grad()
    def apply(self, bundle: StateBundle) -> tuple[int, int]:
        """Copy a received state into the live tensors; returns (committed rounds, inner step)."""
        live = self.tensors()
        for name, tensor in bundle.tensors.items():
            if not name.startswith("outer."):
                live[name].copy_(tensor)
        for p, opt in enumerate(self.outer_optimizers):
            prefix = f"outer.{p}."
            load_optimizer_state_tensors(
                opt, {k[len(prefix) :]: v for k, v in bundle.tensors.items() if k.startswith(prefix)}
            )
        return int(bundle.meta["committed"]), int(bundle.meta["inner_step"])


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
