"""Pipeline parallelism inside a replica group: the blocks split by depth into stages, microbatches
run through them by a schedule (``torch.distributed.pipelining``).

GPipe (Huang et al. 2019) runs every microbatch's forward, then every backward; 1F1B (Narayanan
et al. 2019) alternates them once the pipeline is full, so a stage keeps at most pp microbatches'
activations; interleaved 1F1B (Narayanan et al. 2021) gives each worker v stages, looped (worker i
holds stages i, i + pp, ...), which cuts the bubble (pp − 1)/(m + pp − 1) of m microbatches about
v-fold. The first stage holds the embedding, the last the final norm and the head.

A stage is the model's own ``Transformer`` with only its blocks (keyed by their index in the whole
model) and parts, so every parameter keeps the name it has in the whole model: fragments,
digests, checkpoints and heals match by those names whichever worker holds them. Gradients are
exactly the whole model's: each microbatch's loss is its mean over its tokens and the schedule
divides the summed gradients by m (equal microbatches), as one pass over the micro-batch would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from diloco.config.model import ModelConfig
from diloco.config.parallel import ParallelConfig
from diloco.ft.state import is_dtensor
from diloco.train.model import Transformer, meta_model

Batch = tuple[torch.Tensor, torch.Tensor]


def stage_blocks(parallel: ParallelConfig, n_blocks: int) -> list[range]:
    """The blocks of each stage, first to last."""
    out, start = [], 0
    for count in parallel.blocks_per_stage(n_blocks):
        out.append(range(start, start + count))
        start += count
    return out


def worker_stages(parallel: ParallelConfig, pp_index: int) -> list[int]:
    """The stages the workers at pipeline position ``pp_index`` run (looped: pp_index, pp_index + pp, ...)."""
    return [pp_index + k * parallel.pp for k in range(parallel.stages_per_rank)]


def build_stage(whole: Transformer, blocks: range, *, first: bool, last: bool) -> Transformer:
    """A ``Transformer`` that shares ``whole``'s modules for ``blocks`` (and the embedding if ``first``,
    the norm and head if ``last``) and holds nothing else."""
    stage = meta_model(whole.cfg)
    stage.layers = nn.ModuleDict({str(i): whole.layers[str(i)] for i in blocks})
    stage.tok_embeddings = whole.tok_embeddings if first else None
    stage.norm = whole.norm if last else None
    stage.output = whole.output if last else None
    stage.rope_cos, stage.rope_sin = whole.rope_cos, whole.rope_sin
    return stage


class StageChunks(nn.Module):
    """The stages one worker runs, seen as one model: its parameters under their whole-model names."""

    def __init__(self, chunks: list[Transformer]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for chunk in self.chunks:
            yield from chunk.named_parameters(prefix, recurse, remove_duplicate)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pipeline stage's model runs through its PipelineRunner, not as a whole")


def split_for_worker(whole: Transformer, parallel: ParallelConfig, pp_index: int) -> StageChunks:
    """The stages of the workers at pipeline position ``pp_index``, cut out of the whole model."""
    ranges = stage_blocks(parallel, whole.cfg.n_layers)
    last = parallel.stages - 1
    return StageChunks(
        [build_stage(whole, ranges[s], first=s == 0, last=s == last) for s in worker_stages(parallel, pp_index)]
    )


def stage_parameter_names(cfg: ModelConfig, parallel: ParallelConfig, pp_index: int) -> list[str]:
    """The parameter names the workers at ``pp_index`` hold, in their model's order (no storage needed)."""
    return [name for name, _ in split_for_worker(meta_model(cfg), parallel, pp_index).named_parameters()]


class PipelineRunner:
    """Runs one worker's stages through the group's schedule: a training micro-batch (forward and
    backward), an evaluation batch (forward), and the gradient norm over every stage."""

    def __init__(
        self,
        chunks: StageChunks,
        parallel: ParallelConfig,
        pp_index: int,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        microbatches: int,
    ) -> None:
        # Imported here: torch's pipelining module takes seconds to import, and only a pipelined worker needs it.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.device = device
        self.pp_group = pp_group
        indices = worker_stages(parallel, pp_index)
        stages = [
            PipelineStage(chunk, index, parallel.stages, device, group=pp_group)
            for chunk, index in zip(chunks.chunks, indices, strict=True)
        ]
        self.has_first = indices[0] == 0
        self.has_last = indices[-1] == parallel.stages - 1
        self._scale = 1.0
        if parallel.pp_schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=self._loss)
        else:
            single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[parallel.pp_schedule]
            self.schedule = single(stages[0], microbatches, loss_fn=self._loss)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) * self._scale

    def _run(self, batch: Batch, train: bool) -> torch.Tensor | None:
        inputs, targets = (t.to(self.device, non_blocking=True) for t in batch)
        args = (inputs,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else contextlib.nullcontext()
        )
        with autocast:
            run(*args, target=targets if self.has_last else None, losses=losses)
        if not self.has_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    def forward_backward(self, batch: Batch, scale: float) -> torch.Tensor | None:
        """Accumulate ``scale`` x the gradient of the micro-batch's mean loss; the loss, on the last stage only."""
        self._scale = scale
        try:
            loss = self._run(batch, train=True)
        finally:
            self._scale = 1.0
        return None if loss is None else loss / scale

    def eval_loss(self, batch: Batch) -> torch.Tensor | None:
        """The batch's mean loss, on the last stage only (every stage must call it)."""
        return self._run(batch, train=False)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip to the norm of the whole model's gradient: each stage's norm (already over its FSDP
        and tp shards) squared and summed over the pipeline."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if is_dtensor(norm):
            norm = norm.full_tensor()
        squared = norm.double() ** 2
        dist.all_reduce(squared, group=self.pp_group)
        total = squared.sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def gather_stages(
    weights: dict[str, torch.Tensor], cfg: ModelConfig, parallel: ParallelConfig, rank: int, workers: int
) -> dict[str, torch.Tensor]:
    """The whole model's CPU weights on rank 0 from each pipeline position's first worker, which
    holds its stages whole (``weights``); a collective over the group (others send or wait).

    Sent as raw tensors in the order both sides derive from the config, so nothing is pickled.
    """
    stride = workers // parallel.pp  # the ranks of one pipeline position: its dp x tp workers
    shapes = {name: p for name, p in meta_model(cfg).named_parameters()}
    if rank == 0:
        whole = dict(weights)
        for k in range(1, parallel.pp):
            for name in stage_parameter_names(cfg, parallel, k):
                whole[name] = torch.empty(shapes[name].shape, dtype=shapes[name].dtype)
                dist.recv(whole[name], src=k * stride)
        return whole
    if rank % stride == 0:
        for name in stage_parameter_names(cfg, parallel, rank // stride):
            dist.send(weights[name].contiguous(), dst=0)
    return {}
