"""``parallel.*``: how a replica group's workers split the model among themselves."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.config.base import check
from diloco.config.model import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """``tp``: tensor-parallel degree inside a group (Megatron-style: attention heads and the MLP's
    hidden units split over ``tp`` workers). A group's W = ``cluster.workers_per_group`` workers
    form a dp x tp mesh, dp = W / tp, with tp innermost (the workers of one host share the
    fastest link); FSDP2 shards over dp. Rank r of every group holds the same shard, so lane r
    reduces like with like: every group must have the same mesh.

    ``sequence_parallel``: the tp workers also split the residual stream and the norms along the
    sequence (Korthikanti et al. 2022): tp-fold less activation memory there, the same bytes sent."""

    tp: int = 1
    sequence_parallel: bool = False

    def validate(self) -> None:
        check(self.tp >= 1, "parallel.tp", self.tp, "must be a positive integer (1: no tensor parallelism)")
        check(
            not self.sequence_parallel or self.tp > 1,
            "parallel.sequence_parallel",
            self.sequence_parallel,
            "splits the sequence over the tensor-parallel workers: set parallel.tp > 1, or drop it",
        )

    def check_fits(self, model: ModelConfig, workers_per_group: int, seq_len: int) -> None:
        """Refuse a degree the group or the model cannot be split by, naming what it must divide."""
        fix = "choose a tp that divides it"
        if self.sequence_parallel:
            check(
                seq_len % self.tp == 0,
                "parallel.tp",
                self.tp,
                f"must divide trainer.seq_len={seq_len} with parallel.sequence_parallel=true; {fix}",
            )
        check(
            workers_per_group % self.tp == 0,
            "parallel.tp",
            self.tp,
            f"must divide cluster.workers_per_group={workers_per_group} (dp x tp workers); {fix}",
        )
        for key, value in (
            ("model.n_heads", model.n_heads),
            ("model.n_kv_heads", model.n_kv_heads),
            ("the MLP width (model.ffn_hidden_dim)", model.ffn_dim),
        ):
            check(value % self.tp == 0, "parallel.tp", self.tp, f"must divide {key}={value}: {fix}")

    def dp(self, workers_per_group: int) -> int:
        """The data-parallel (FSDP) degree: how many distinct batches a group step reads."""
        return workers_per_group // self.tp
