"""``parallel.*``: how a replica group's workers split the model among themselves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.base import check
from diloco.config.model import ModelConfig

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]


@dataclass(frozen=True)
class ParallelConfig:
    """``tp``: tensor-parallel degree inside a group (Megatron-style: attention heads and the MLP's
    hidden units split over ``tp`` workers). ``pp``: pipeline stages inside a group (the blocks
    split by depth: the embedding on the first stage, the norm and head on the last). A group's
    W = ``cluster.workers_per_group`` workers form a pp x dp x tp mesh, dp = W / (pp x tp), pp
    outermost and tp innermost (the workers of one host share the fastest link); FSDP2 shards over
    dp. Rank r of every group holds the same stage and shard, so lane r reduces like with like:
    every group must have the same mesh.

    ``sequence_parallel``: the tp workers also split the residual stream and the norms along the
    sequence (Korthikanti et al. 2022): tp-fold less activation memory there, the same bytes sent.

    ``pp_schedule``: GPipe (all forwards, then all backwards), 1F1B (one forward, one backward:
    at most pp microbatches' activations alive) or interleaved 1F1B (``pp_stages_per_rank`` = v
    stages per worker, looped: worker i holds stages i, i + pp, ...; the bubble shrinks v-fold).
    ``pp_split``: blocks per stage, first to last (pp x v entries); empty: as even as the count allows.
    """

    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    pp_schedule: PipelineSchedule = "1f1b"
    pp_stages_per_rank: int | None = None  # None: 2 for interleaved_1f1b, else 1
    pp_split: tuple[int, ...] = ()

    def validate(self) -> None:
        check(self.tp >= 1, "parallel.tp", self.tp, "must be a positive integer (1: no tensor parallelism)")
        check(self.pp >= 1, "parallel.pp", self.pp, "must be a positive integer (1: no pipeline parallelism)")
        check(
            not self.sequence_parallel or self.tp > 1,
            "parallel.sequence_parallel",
            self.sequence_parallel,
            "splits the sequence over the tensor-parallel workers: set parallel.tp > 1, or drop it",
        )
        check(
            not (self.sequence_parallel and self.pp > 1),
            "parallel.sequence_parallel",
            self.sequence_parallel,
            f"does not compose with parallel.pp={self.pp} yet (a stage would receive a sequence shard); "
            "set parallel.sequence_parallel=false or parallel.pp=1",
        )
        check(
            self.pp_schedule in ("gpipe", "1f1b", "interleaved_1f1b"),
            "parallel.pp_schedule",
            self.pp_schedule,
            "must be gpipe, 1f1b or interleaved_1f1b",
        )
        v = self.stages_per_rank
        if self.pp_schedule == "interleaved_1f1b":
            check(v >= 2, "parallel.pp_stages_per_rank", v, "must be >= 2 for interleaved_1f1b (or use 1f1b)")
        else:
            check(
                v == 1,
                "parallel.pp_stages_per_rank",
                v,
                f"must be 1 for pp_schedule={self.pp_schedule}: several stages per worker need "
                "parallel.pp_schedule=interleaved_1f1b",
            )
        if self.pp_split:
            check(
                len(self.pp_split) == self.stages and all(n >= 1 for n in self.pp_split),
                "parallel.pp_split",
                list(self.pp_split),
                f"must give a positive block count for each of the {self.stages} stages "
                "(parallel.pp x parallel.pp_stages_per_rank), first to last",
            )

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule == "interleaved_1f1b" else 1

    @property
    def stages(self) -> int:
        """Pipeline stages over the whole group: pp workers x stages per worker."""
        return self.pp * self.stages_per_rank

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
        if self.pp == 1:
            check(
                workers_per_group % self.tp == 0,
                "parallel.tp",
                self.tp,
                f"must divide cluster.workers_per_group={workers_per_group} (dp x tp workers); {fix}",
            )
        else:
            check(
                workers_per_group % (self.pp * self.tp) == 0,
                "parallel.pp",
                self.pp,
                f"pp x tp = {self.pp * self.tp} must divide cluster.workers_per_group={workers_per_group} "
                "(a group's workers are pp x dp x tp); choose degrees whose product divides it",
            )
        for key, value in (
            ("model.n_heads", model.n_heads),
            ("model.n_kv_heads", model.n_kv_heads),
            ("the MLP width (model.ffn_hidden_dim)", model.ffn_dim),
        ):
            check(value % self.tp == 0, "parallel.tp", self.tp, f"must divide {key}={value}: {fix}")
        if self.pp == 1:
            return
        check(
            self.stages <= model.n_layers,
            "parallel.pp",
            self.pp,
            f"{self.stages} stages (pp x pp_stages_per_rank={self.stages_per_rank}) for model.n_layers="
            f"{model.n_layers} blocks: every stage needs at least one; lower parallel.pp",
        )
        check(
            not self.pp_split or sum(self.pp_split) == model.n_layers,
            "parallel.pp_split",
            list(self.pp_split),
            f"must add up to model.n_layers={model.n_layers}",
        )
        check(
            not model.tie_embeddings,
            "parallel.pp",
            self.pp,
            "cannot split a model with tied embeddings (model.tie_embeddings=true): the first stage holds the "
            "embedding and the last the head; set model.tie_embeddings=false or parallel.pp=1",
        )

    def dp(self, workers_per_group: int) -> int:
        """The data-parallel (FSDP) degree: how many distinct batches a group step reads."""
        return workers_per_group // (self.tp * self.pp)

    def dp_index(self, rank: int, workers_per_group: int) -> int:
        """Which batches worker ``rank`` reads (rank = (pp index x dp + dp index) x tp + tp index):
        the tp workers of one dp index, and its workers of every stage, read the same ones."""
        return (rank // self.tp) % self.dp(workers_per_group)

    def pp_index(self, rank: int, workers_per_group: int) -> int:
        """The pipeline stage (of every v) that worker ``rank`` runs: pp is the mesh's outermost dimension."""
        return rank // (self.tp * self.dp(workers_per_group))

    def mesh_shape(self, workers_per_group: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The group's device mesh (shape, dimension names), dimensions of size 1 other than dp left out."""
        dims = [("pp", self.pp), ("shard", self.dp(workers_per_group)), ("tp", self.tp)]
        kept = [(name, size) for name, size in dims if size > 1 or name == "shard"]
        return tuple(size for _, size in kept), tuple(name for name, _ in kept)

    def blocks_per_stage(self, n_blocks: int) -> list[int]:
        """Blocks of each stage, first to last: ``pp_split``, or the first n % S stages one more."""
        if self.pp_split:
            return list(self.pp_split)
        base, extra = divmod(n_blocks, self.stages)
        return [base + (1 if s < extra else 0) for s in range(self.stages)]

    def microbatches(self, requested: int | None) -> int:
        """``trainer.microbatches``, or one per stage when it is null."""
        return requested if requested is not None else self.stages

    def check_microbatches(self, requested: int | None, batch_size: int) -> None:
        """A micro-batch must cut into equal pipeline microbatches, enough for the schedule."""
        key = "trainer.microbatches"
        if self.pp == 1:
            check(
                requested in (None, 1),
                key,
                requested,
                "cuts batches for pipeline stages only (parallel.pp > 1); accumulate with trainer.grad_accum instead",
            )
            return
        m = self.microbatches(requested)
        check(batch_size % m == 0, key, m, f"must divide trainer.batch_size={batch_size}; choose a divisor")
        if self.pp_schedule == "1f1b":
            check(m >= self.pp, key, m, f"must be >= parallel.pp={self.pp} for pp_schedule=1f1b (or use gpipe)")
        if self.pp_schedule == "interleaved_1f1b":
            check(
                m % self.pp == 0,
                key,
                m,
                f"must be a multiple of parallel.pp={self.pp} for pp_schedule=interleaved_1f1b",
            )
