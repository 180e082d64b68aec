"""The whole job's configuration: each component's dataclass, composed and cross-checked once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from diloco.config.algo import AlgoConfig
from diloco.config.base import check, flat_keys, from_dict, to_dict
from diloco.config.cluster import ClusterConfig
from diloco.config.data import DataConfig
from diloco.config.faults import FaultsConfig
from diloco.config.hf_llama import with_pretrained_shape
from diloco.config.inner_opt import InnerOptConfig
from diloco.config.logger import LoggerConfig
from diloco.config.model import ModelConfig
from diloco.config.parallel import ParallelConfig
from diloco.config.prepare import PrepareConfig
from diloco.config.sample import SampleConfig
from diloco.config.tokens_meta import resolve_data_section
from diloco.config.trainer import TrainerConfig
from outer_opt import OuterOptConfig


@dataclass(frozen=True)
class GroupConfig:
    """Which replica group this process belongs to (``role=group`` on a multi-host job)."""

    id: int = 0


@dataclass(frozen=True)
class JobConfig:
    """Everything a run needs; built from the composed hydra config by ``run.py``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner_opt: InnerOptConfig = field(default_factory=InnerOptConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    outer_opt: OuterOptConfig = field(default_factory=OuterOptConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    role: Literal["local", "lighthouse", "group", "summary", "eval", "sample", "export", "prepare"] = "local"
    group: GroupConfig = field(default_factory=GroupConfig)
    name: str = "diloco"
    checkpoint: str | None = None  # role=eval / sample / export: a finished run's directory or its model.pt
    sample: SampleConfig = field(default_factory=SampleConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)  # role=prepare: a corpus into tokens

    def validate(self) -> None:
        for part in (
            self.model,
            self.data,
            self.inner_opt,
            self.trainer,
            self.algo,
            self.outer_opt,
            self.cluster,
            self.parallel,
            self.logger,
            self.faults,
            self.sample,
            self.prepare,
        ):
            part.validate()
        self.algo.check_fits(n_blocks=self.model.n_layers)
        self.parallel.check_fits(self.model, self.cluster.workers_per_group, self.trainer.seq_len)
        self.parallel.check_microbatches(self.trainer.microbatches, self.trainer.batch_size)
        check(
            not (self.trainer.compile and self.parallel.tp > 1),
            "trainer.compile",
            self.trainer.compile,
            f"does not compose with parallel.tp={self.parallel.tp} yet: torch 2.13 fails in the compiled blocks' "
            "tensor-parallel backward; set trainer.compile=false or parallel.tp=1",
        )
        check(
            self.data.vocab_size <= self.model.vocab_size,  # data.validate() above refused None
            "model.vocab_size",
            self.model.vocab_size,
            f"is smaller than the tokenizer's vocabulary, data.vocab_size={self.data.vocab_size}: ids past the "
            "model's embedding rows cannot be trained; leave model.vocab_size unset (it follows the data's) or "
            "raise it, or prepare the corpus with a smaller tokenizer",
        )
        check(
            self.trainer.seq_len <= self.model.max_seq_len,
            "trainer.seq_len",
            self.trainer.seq_len,
            f"exceeds model.max_seq_len={self.model.max_seq_len}; lower it or raise model.max_seq_len",
        )
        every, h = self.trainer.checkpoint.every, self.algo.sync_every
        check(
            not every or self.algo.name in ("ddp", "local") or every % h == 0,
            "trainer.checkpoint.every",
            every,
            f"must be a multiple of algo.sync_every={h}: a checkpoint is taken between rounds",
        )
        check(
            self.cluster.spares == 0 or self.role in ("local", "summary", "eval", "sample", "export", "prepare"),
            "cluster.spares",
            self.cluster.spares,
            f"warm spares are kept by the local launcher (role=local), not with role={self.role}: under "
            "torchrun or Slurm keep spare nodes with the orchestrator, or set cluster.spares=0",
        )
        check(
            self.faults.slow_group < self.cluster.groups,
            "faults.slow_group",
            self.faults.slow_group,
            f"must be a group id in [0, cluster.groups={self.cluster.groups}), or -1 for none",
        )
        check(
            not self.faults.kill_every or self.faults.min_alive < self.cluster.groups,
            "faults.min_alive",
            self.faults.min_alive,
            f"must be < cluster.groups={self.cluster.groups} with faults.kill_every set: a kill must leave "
            "min_alive other groups holding the state, so none could ever happen; lower it or add groups",
        )
        check(
            0 <= self.group.id < self.cluster.groups,
            "group.id",
            self.group.id,
            f"must be in [0, cluster.groups={self.cluster.groups})",
        )


TRAINING_SECTIONS = ("model", "data", "inner_opt", "trainer", "algo", "outer_opt", "parallel")


def training_config(job: JobConfig) -> dict[str, Any]:
    """What every group of a job must share, flat (``algo.sync_every`` -> 50): the lighthouse
    refuses a group whose values differ, naming the keys."""
    cluster = {"cluster.groups": job.cluster.groups, "cluster.workers_per_group": job.cluster.workers_per_group}
    return cluster | flat_keys({section: getattr(job, section) for section in TRAINING_SECTIONS})


def job_config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """Typed, validated config from a plain dict; the model's vocabulary follows the data's, or with
    ``model.init_from`` the model's shape and vocabulary come from that checkpoint's config.json."""
    raw = dict(raw)
    model = dict(raw.get("model") or {})
    data = from_dict(DataConfig, resolve_data_section(raw.get("data") or {}), "data")
    raw["data"] = to_dict(data)
    if model.get("init_from"):
        model = with_pretrained_shape(model)
    if data.vocab_size is not None:  # None (a uint32 token file without metadata): data.validate() says the fix
        model.setdefault("vocab_size", data.vocab_size)
    raw["model"] = model
    job = from_dict(JobConfig, raw)
    job.validate()
    return job
