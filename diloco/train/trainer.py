"""One replica group's inner loop: the same code for one worker or N FSDP2-sharded workers."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from diloco.config.trainer import TrainerConfig
from diloco.ft.state import is_dtensor
from diloco.train.data import ShardedBatches
from diloco.train.flops import Utilization
from diloco.train.logger import perplexity
from diloco.train.sync_hooks import NoSync, OuterOutcome, SyncHooks

if TYPE_CHECKING:
    from diloco.train.pipeline import PipelineRunner


@dataclass(frozen=True)
class TrainResult:
    """What a group reports when its inner loop ends (goes into summary.json)."""

    steps: int
    tokens_seen: int
    final_train_loss: float
    final_eval_loss: float
    train_seconds: float
    interrupted: bool = False  # a planned stop (SIGTERM, Ctrl-C) ended it before max_steps
    resumed_tokens: int = 0  # of tokens_seen, those trained before the checkpoint it resumed from

    @property
    def tokens_per_s(self) -> float:
        trained_here = self.tokens_seen - self.resumed_tokens
        return trained_here / self.train_seconds if self.train_seconds > 0 else 0.0


Batch = tuple[torch.Tensor, torch.Tensor]
MetricsCallback = Callable[[dict[str, float], int], None]
CheckpointCallback = Callable[["Trainer"], None]


class Trainer:
    """AdamW inner steps with grad accumulation, clipping, bf16 autocast on CUDA, periodic eval."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        batches: ShardedBatches,
        eval_set: list[Batch],
        cfg: TrainerConfig,
        grad_clip: float,
        device: torch.device,
        sharded: bool,
        on_metrics: MetricsCallback | None = None,
        outer: SyncHooks | None = None,
        on_checkpoint: CheckpointCallback | None = None,
        stop_requested: Callable[[], bool] | None = None,
        pace: Callable[[float], None] | None = None,
        utilization: Utilization | None = None,
        pipeline: PipelineRunner | None = None,
    ) -> None:
        """``on_checkpoint(trainer)`` saves the worker's state (every ``cfg.checkpoint.every`` steps,
        at a planned stop and at the end); ``stop_requested`` says a planned stop was asked for
        (a signal): training then stops after the next round, with every group at that round.
        ``pace(seconds)`` runs after each inner step (an injected straggler's delay); ``utilization``
        adds the achieved TFLOP/s and MFU beside tokens/s. With ``pipeline`` (this worker's stages of
        a pipeline-parallel group) micro-batches run through its schedule, and the losses the group
        reports are its last stage's. Without ``outer`` the group trains alone (``NoSync``) and a
        planned stop is agreed at its log lines."""
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.batches = batches
        self.eval_set = eval_set
        self.cfg = cfg
        self.grad_clip = grad_clip
        self.device = device
        self.sharded = sharded
        self.on_metrics = on_metrics
        self.outer: SyncHooks = NoSync() if outer is None else outer
        self.stop_every = cfg.log_every if outer is None else 1  # steps between planned-stop checks
        self.on_checkpoint = on_checkpoint
        self.stop_requested = stop_requested
        self.pace = pace
        self.utilization = utilization
        self.pipeline = pipeline
        self.step = 0
        self.resumed_tokens = 0  # tokens this group trained before the checkpoint it resumed from
        self.trained_steps = 0
        self._saved_at: int | None = None  # the step of this process's last checkpoint
        self.sync_metrics: dict[str, float] = {}

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this worker's micro-batches; returns (mean loss, grad norm)."""
        micro_batches = self.batches.next_step()
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            if self.pipeline is not None:  # the loss exists on the last stage only
                loss = self.pipeline.forward_backward(batch, 1 / len(micro_batches))
                total += 0.0 if loss is None else loss
                continue
            if self.sharded:
                # Reduce-scatter gradients once per step, not once per micro-batch.
                self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            loss = self._loss(batch)
            (loss / len(micro_batches)).backward()
            total += loss.detach()
        outcome = self.outer.before_optimizer_step(self.step + 1)
        self.sync_metrics.update(self._follow(outcome))
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        if self.pipeline is not None:
            grad_norm = self.pipeline.clip_grad_norm(list(self.model.parameters()), max_norm)
        else:
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if is_dtensor(grad_norm):
            grad_norm = grad_norm.full_tensor()
        if not outcome.skip_step:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total / len(micro_batches), grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss (nats per token) over the whole group's evaluation windows."""
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64)
        for batch in self.eval_set:
            loss = self._loss(batch) if self.pipeline is None else self.pipeline.eval_loss(batch)
            if loss is not None:  # pipeline stages before the last count nothing
                sums[0] += loss.item() * batch[1].numel()
                sums[1] += batch[1].numel()
        self.model.train()
        return _group_mean(sums)

    def fit(self) -> TrainResult:
        """Run inner steps until ``max_steps``, logging and evaluating on the way."""
        cfg = self.cfg
        tokens_per_step = self.batches.tokens_per_step
        start = window_start = time.perf_counter()
        # Summed on the device, read once per log line: a read per step would stall the GPU's queue.
        window_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        window_steps = 0
        train_loss = eval_loss = math.nan
        self.trained_steps = 0  # steps this process took itself (a group that heals jumps over others)
        self._follow(self.outer.join())
        while self.step < cfg.max_steps:
            step_started = time.perf_counter()
            loss, grad_norm = self.train_step()
            if self.pace is not None:
                self.pace(time.perf_counter() - step_started)
            self.trained_steps += 1
            window_loss += loss.double()
            window_steps += 1
            metrics, self.sync_metrics = self.sync_metrics, {}
            metrics.update(self._follow(self.outer.after_inner_step(self.step, tokens_per_step)))
            last = self.step >= cfg.max_steps
            if self.step % cfg.log_every == 0 or last:
                elapsed = time.perf_counter() - window_start
                steps = window_steps
                counted = steps if self.pipeline is None or self.pipeline.has_last else 0
                train_loss = _group_mean(
                    torch.stack([window_loss.cpu(), torch.tensor(float(counted), dtype=torch.float64)])
                )
                metrics.update(
                    {
                        "train/loss": train_loss,
                        "train/lr": self.scheduler.get_last_lr()[0],
                        "train/grad_norm": grad_norm.item(),
                        "train/step_ms": 1000.0 * elapsed / steps,
                        "train/tokens_per_s": tokens_per_step * steps / elapsed,
                        "train/tokens": float(tokens_per_step * self.step),
                    }
                )
                if self.utilization is not None:
                    metrics.update(self.utilization.metrics(metrics["train/tokens_per_s"]))
                window_loss.zero_()
                window_steps = 0
                window_start = time.perf_counter()
                self.outer.observe(self.step, metrics)
            if (cfg.eval_every and self.step % cfg.eval_every == 0) and not last:
                eval_loss = self.evaluate()
                metrics.update({"eval/loss": eval_loss, "eval/ppl": perplexity(eval_loss)})
                self.outer.observe(self.step, {"eval/loss": eval_loss})  # the status page's eval curve
                window_start = time.perf_counter()  # evaluation time is not training throughput
            if metrics and self.on_metrics is not None:
                self.on_metrics(metrics, self.step)
            if not last and self._checkpoint_due():
                self._save_checkpoint()
            if not last and self._stop_agreed():
                return self._stopped(tokens_per_step * self.trained_steps, time.perf_counter() - start, train_loss)
        train_seconds = time.perf_counter() - start
        # The final evaluation, also for a group that healed straight to the last step.
        self.outer.finish(self.step)  # until every group has finished: the state may still change
        self._save_checkpoint()
        self.outer.load_global_into_local()  # the result of DiLoCo is θ_g
        eval_loss = self.evaluate()
        if self.on_metrics is not None:
            self.on_metrics({"eval/loss": eval_loss, "eval/ppl": perplexity(eval_loss)}, self.step)
        return TrainResult(
            steps=self.step,
            tokens_seen=self.resumed_tokens + tokens_per_step * self.trained_steps,
            final_train_loss=train_loss,
            final_eval_loss=eval_loss,
            train_seconds=train_seconds,
            resumed_tokens=self.resumed_tokens,
        )

    def _save_checkpoint(self) -> None:
        """Save once per step (a planned stop right after a periodic checkpoint writes nothing new)."""
        if self.on_checkpoint is not None and self._saved_at != self.step:
            self.on_checkpoint(self)
            self._saved_at = self.step

    def _checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint.every
        if self.on_checkpoint is None or not every or self.step % every:
            return False
        return self.outer.between_rounds(self.step)

    def _stop_agreed(self) -> bool:
        """A planned stop, once a round has ended (every ``stop_every`` steps); every rank of the
        group decides the same, so all of them stop at this step."""
        if self.stop_requested is None or self.step % self.stop_every or not self.outer.between_rounds(self.step):
            return False
        asked = torch.tensor([float(self.stop_requested())], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        return bool(asked.item())

    def _stopped(self, tokens: int, train_seconds: float, train_loss: float) -> TrainResult:
        """A planned stop: save the state if checkpoints are on; the model is evaluated no more."""
        self._save_checkpoint()
        return TrainResult(
            steps=self.step,
            tokens_seen=self.resumed_tokens + tokens,
            final_train_loss=train_loss,
            final_eval_loss=math.nan,
            train_seconds=train_seconds,
            interrupted=True,
            resumed_tokens=self.resumed_tokens,
        )

    def progress_state(self) -> dict[str, Any]:
        """The group's position (step, data read position, tokens trained), JSON-friendly, so a
        restart does not replay data."""
        return {
            "step": self.step,
            "data": self.batches.state_dict(),
            "tokens_seen": self.resumed_tokens + self.batches.tokens_per_step * self.trained_steps,
        }

    def load_progress_state(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state["data"])
        self.set_step(int(state["step"]))
        self.resumed_tokens = int(state.get("tokens_seen", 0))

    def set_step(self, step: int) -> None:
        """Move to inner step ``step``: lr schedule and data read position follow it.

        A group that healed from a peer jumps to the peer's step; its data position is
        where it would be had it never stopped (its own shard, step × windows per step),
        so it neither replays nor shares windows.
        """
        self.step = step
        self.batches.consumed = step * self.batches.tokens_per_step // self.batches.seq_len
        # LambdaLR sets the lr of step k when stepped to last_epoch=k.
        self.scheduler.last_epoch = self.step - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()

    def _follow(self, outcome: OuterOutcome) -> dict[str, float]:
        if outcome.jump_to_step is not None:
            self.set_step(outcome.jump_to_step)
        if outcome.end_training:  # the last step: the job's end protocol and the final model follow
            self.set_step(self.cfg.max_steps)
        return outcome.metrics

    def _loss(self, batch: Batch) -> torch.Tensor:
        return next_token_loss(self.model, batch, self.device)


def next_token_loss(model: nn.Module, batch: Batch, device: torch.device) -> torch.Tensor:
    """Mean cross-entropy (nats per token) of ``model``'s next-token predictions; bf16 autocast on CUDA."""
    inputs, targets = (t.to(device, non_blocking=True) for t in batch)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    with autocast:
        logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _group_mean(sums: torch.Tensor) -> float:
    """All-reduce ``[sum, count]`` over the group (when there is one) and divide."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()
