"""Muon for the hidden matrices, AdamW for the rest: MuLoCo's inner optimizer (arXiv 2505.23725).

Muon (Jordan et al. 2024) steps each hidden 2-D weight W by the orthogonalized momentum: with
momentum buffer B ← μ·B + g and the Nesterov update u = g + μ·B, it takes O ≈ U·Vᵀ of
u = U·Σ·Vᵀ from a quintic Newton–Schulz iteration and sets
W ← (1 − lr·λ)·W − lr·0.2·sqrt(max(rows, cols))·O. The factor 0.2·sqrt(max(rows, cols)) gives the
update the RMS of a typical AdamW update (Liu et al. 2025, "Muon is Scalable for LLM Training"),
so one ``inner_opt.lr`` (and its schedule) serves both the Muon and the AdamW parameters.
Embeddings, the output head, norms and biases take AdamW, as the Muon recipe does.

A sharded weight (an FSDP2 or tensor-parallel DTensor) is orthogonalized whole, and the work is
spread over the mesh's workers (``orthogonalize``): in turns of as many matrices as the mesh has
workers, worker k keeps the k-th gathered u, runs the iteration on it and broadcasts O, and each
worker keeps its own shard of every O. B stays sharded like W.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from diloco.ft.state import is_dtensor

# The quintic's coefficients (a, b, c): X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ. They push every
# singular value of the Frobenius-normalized matrix towards 1 within 5 steps, to somewhere in
# about [0.7, 1.2] rather than exactly 1, which trains as well (Jordan et al. 2024).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2  # Liu et al. 2025: AdamW's update RMS is about 0.2


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights inside the transformer blocks (attention and feed-forward): Muon's."""
    return [p for name, p in model.named_parameters() if p.ndim == 2 and "layers" in name.split(".")]


def rms_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """0.2·sqrt(max(rows, cols)): an orthogonal update's RMS is 1/sqrt(max(rows, cols))."""
    return RMS_MATCH * math.sqrt(max(shape[0], shape[1]))


@torch.no_grad()
def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """O ≈ U·Vᵀ of g = U·Σ·Vᵀ, in fp32: g / ‖g‖_F has singular values <= 1, then ``steps`` quintic steps
    on the wide orientation (rows <= cols), so A = X·Xᵀ is the smaller Gram matrix."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    x = x / (x.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon on param groups with ``muon=True`` (2-D only), AdamW (decoupled decay, bias-corrected) on the others.

    Every state tensor exists from construction (zeros, step 0), so a healing group has tensors of
    its peer's names and shapes to receive into and a checkpoint holds the whole state.
    """

    def __init__(
        self,
        params: Iterable[dict],
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        ns_steps: int,
        betas: tuple[float, float],
        eps: float,
        spread: bool = True,
    ) -> None:
        """``spread``: share the Newton–Schulz work on sharded matrices among the mesh's workers
        (``orthogonalize``); False runs every matrix on every worker (the same bits, W times the work)."""
        self.spread = spread
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "ns_steps": ns_steps}
        defaults |= {"betas": betas, "eps": eps, "muon": False}
        super().__init__(list(params), defaults)
        for group in self.param_groups:
            for p in group["params"]:
                assert not group["muon"] or p.ndim == 2, (
                    f"Muon orthogonalizes matrices only, got shape {tuple(p.shape)}"
                )
                if group["muon"]:
                    self.state[p] = {"step": torch.tensor(0.0), "momentum_buffer": torch.zeros_like(p)}
                else:
                    self.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_steps(params, group)
            else:
                for p in params:
                    self._adamw_step(p, group)
        return loss

    def _muon_steps(self, params: list[torch.Tensor], group: dict) -> None:
        """B ← μ·B + g and u = g + μ·B for every matrix, then O of all of them at once, then the step."""
        mu, updates = group["momentum"], []
        for p in params:
            state = self.state[p]
            state["step"] += 1
            g, buf = _local(_grad_like(p)), _local(state["momentum_buffer"])
            buf.mul_(mu).add_(g)
            updates.append(g.add(buf, alpha=mu))  # Nesterov
        lr = group["lr"]
        for p, o in zip(params, orthogonalize(params, updates, group["ns_steps"], self.spread), strict=True):
            w = _local(p)
            w.mul_(1 - lr * group["weight_decay"])
            w.add_(o.to(w.dtype), alpha=-lr * rms_scale(p.shape))

    def _adamw_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        state["step"] += 1
        t = state["step"].item()
        g, w = _local(_grad_like(p)), _local(p)
        m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        w.mul_(1 - lr * group["weight_decay"])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(group["eps"])
        w.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


def orthogonalize(
    params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], steps: int, spread: bool = True
) -> list[torch.Tensor]:
    """O of each u in ``updates`` (this worker's part of it, laid out as its parameter).

    A plain tensor is orthogonalized here. Sharded matrices go in turns of W, the number of workers
    of their mesh: every worker gathers each u of the turn (all in the same order), worker k keeps
    the k-th and runs Newton–Schulz on it, then broadcasts O, and every worker keeps its shard. Each
    worker runs 1/W of the iterations; the same input gives the same bits on every worker, so the
    result equals running them all everywhere (``spread`` False, or a mesh no process group spans).
    """
    out: list[torch.Tensor | None] = [None] * len(params)
    sharded: dict[object, list[int]] = {}
    for i, (p, u) in enumerate(zip(params, updates, strict=True)):
        if is_dtensor(p):
            sharded.setdefault(p.device_mesh, []).append(i)
        else:
            out[i] = newton_schulz(u, steps)
    for mesh, indices in sharded.items():
        group = _spanning_group(mesh) if spread else None
        ranks = mesh.mesh.flatten().tolist()
        if group is None:
            for i in indices:
                out[i] = _own_shard(newton_schulz(_whole(updates[i], params[i]), steps), params[i])
            continue
        me = ranks.index(dist.get_rank())
        for start in range(0, len(indices), len(ranks)):
            turn = indices[start : start + len(ranks)]
            mine = None
            for k, i in enumerate(turn):
                whole = _whole(updates[i], params[i])  # a collective: every worker, every matrix
                if k == me:
                    mine = newton_schulz(whole, steps).contiguous()  # broadcast sends contiguous memory
            for k, i in enumerate(turn):
                o = mine if k == me else torch.empty(params[i].shape, dtype=torch.float32, device=updates[i].device)
                dist.broadcast(o, src=ranks[k], group=group)
                out[i] = _own_shard(o, params[i]).clone()  # a slice of o: keep the shard, not the whole
    return out


def _spanning_group(mesh: object) -> dist.ProcessGroup | None:
    """A process group of exactly the mesh's workers: a 1-D mesh's own, or the default group when
    the mesh spans it (dp x tp inside a replica group); None when no group is at hand."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def _grad_like(p: torch.Tensor) -> torch.Tensor:
    """p's gradient laid out as p is (a replicated norm's gradient may come partial under tensor parallelism)."""
    g = p.grad
    if is_dtensor(p) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g


def _whole(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The full matrix whose shards, laid out as p's, the workers of p's mesh hold (a collective)."""
    from torch.distributed.tensor import DTensor

    sharded = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return sharded.full_tensor()


def _own_shard(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This worker's shard of ``full`` as p is cut: going from replicated to p's placements only
    slices locally (no communication), by the placements' own rules (FSDP2's strided shards included)."""
    from torch.distributed.tensor import DTensor, Replicate

    whole = DTensor.from_local(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    return whole.redistribute(p.device_mesh, p.placements).to_local()
