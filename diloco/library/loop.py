"""``DiLoCo``: fault-tolerant DiLoCo and Streaming DiLoCo around a training loop of one's own.

    with DiLoCo(model, inner_optimizer, max_steps=1000, algo="streaming", fragments=2) as outer:
        while not outer.done:
            loss_of(model, batch_at(outer.step)).backward()
            inner_optimizer.step(); inner_optimizer.zero_grad()
            outer.after_inner_step(tokens=batch_tokens)

Each process of a replica group wraps its model (its shard of it, under FSDP2 or tensor
parallelism) and inner optimizer; every H inner steps the groups all-reduce the pseudo-gradient
Δ = θ_g − θ_l of each fragment through the job's lighthouse and step θ_g with the outer optimizer
(docs/algorithm.md). A group that starts late or restarts takes the live state from a peer in
its first round: ``step`` jumps to the job's. Leaving the block normally waits for every group to
finish and leaves the job's final global model in ``model``; an exception leaves the job, and the
other groups train on without this one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diloco.config.algo import AlgoConfig
from diloco.config.base import ConfigError, check, flat_keys
from diloco.config.cluster import TimeoutsConfig, group_name
from diloco.config.redaction import TOKEN_ENV
from diloco.files import write_json_atomically
from diloco.ft.state import local_tensor
from diloco.library.build import Membership, OuterSettings, build_outer_sync
from diloco.library.group import GROUP_ENV, RUN_DIR_ENV
from diloco.outer.digest import state_digest
from diloco.outer.diloco_sync import OuterSync
from diloco.outer.fragments import count_blocks
from diloco.run_paths import RunPaths
from diloco.train.model import signature
from diloco.train.sync_hooks import OuterOutcome
from outer_opt import OuterOptConfig

LIGHTHOUSE_ENV = "DILOCO_LIGHTHOUSE"  # the lighthouse's URL, http://HOST:PORT
JOB_ENV = "DILOCO_JOB"  # the job's name, as the lighthouse was started with (run.py name=...)
DEFAULT_JOB = "diloco"  # run.py's default name
ALGOS = ("diloco", "streaming")


@dataclass(frozen=True)
class OuterResult:
    """How the job ended for this group: the digest of the global state it holds (every group that
    holds the final model has the same), the rounds committed, and whether the lighthouse named this
    group a holder of the job's final model."""

    digest: str
    rounds: int
    holds_final_model: bool
    report: dict[str, Any]


class DiLoCo:
    """One replica group's process in a fault-tolerant DiLoCo job, driven by the user's inner loop.

    ``algo``: ``"diloco"``, ``"streaming"`` or an ``AlgoConfig`` (the dataclass ``run.py``'s
    ``algo.*`` composes), with any of its fields as keyword arguments (``sync_every=50``,
    ``fragments=2``, ``delay=1``, ``quantize="fp4"``, ``compress="topk"``...). ``outer_opt``: an
    ``OuterOptConfig`` or a registered outer optimizer's name. Where the job is: ``lighthouse``,
    ``group`` and ``job`` (else ``DILOCO_LIGHTHOUSE``, ``DILOCO_GROUP``, ``DILOCO_JOB``), the token
    from ``DILOCO_LIGHTHOUSE_TOKEN``; the group's ranks from ``torch.distributed`` when it is
    initialized (torchrun), the group's own process group. ``run_dir`` (else ``DILOCO_RUN_DIR``):
    where the group's leader writes its commit records and its result, as a job's workers do.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        max_steps: int,
        algo: str | AlgoConfig = "diloco",
        outer_opt: str | OuterOptConfig | None = None,
        lighthouse: str | None = None,
        group: int | None = None,
        job: str | None = None,
        token: str | None = None,
        timeouts: TimeoutsConfig | None = None,
        warmup_share: float = 0.2,
        run_dir: str | Path | None = None,
        environ: Mapping[str, str] = os.environ,
        **algo_keys: Any,
    ) -> None:
        self.max_steps = max_steps
        check_fresh_optimizer(model, inner_optimizer)
        settings = outer_settings(algo, algo_keys, outer_opt, timeouts, max_steps, warmup_share, model)
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        config = shared_config(settings)
        self.member = Membership(
            lighthouse=_given(lighthouse, environ, LIGHTHOUSE_ENV, "lighthouse", "http://HOST:PORT"),
            job=job or environ.get(JOB_ENV) or DEFAULT_JOB,
            group=_group(group, environ),
            signature=signature(model, {}),  # the model alone: differing settings are named by key
            token=token if token is not None else environ.get(TOKEN_ENV, "").strip(),
            rank=rank,
            world_size=world_size,
            config=config | {"initial_weights": weights_digest(model)} if rank == 0 else None,
        )
        run_dir = run_dir or environ.get(RUN_DIR_ENV)
        self.paths = RunPaths(Path(run_dir)) if run_dir else None
        leader_logs = self.paths is not None and self.member.leader
        self.sync: OuterSync = build_outer_sync(
            settings,
            self.member,
            model=model,
            inner_optimizer=inner_optimizer,
            device=_device_of(model),
            commit_log=self.paths.commits(self.member.group) if leader_logs else None,
        )
        self.step = 0  # inner steps of the job's clock this group is at (a heal jumps it to a peer's)
        self.result: OuterResult | None = None
        self._entered = False

    @property
    def done(self) -> bool:
        """Whether the group has run its ``max_steps`` inner steps (or healed to the end)."""
        return self.step >= self.max_steps

    def __enter__(self) -> DiLoCo:
        """Join the job: a group that is behind (late, restarted) takes the live state from a peer here."""
        if self._entered:
            raise RuntimeError("this DiLoCo was entered already: build one per run of the loop")
        self._entered = True
        self.sync.start()
        try:
            self._follow(self.sync.join())
        except BaseException:
            self.sync.close()
            raise
        return self

    def after_inner_step(self, tokens: int = 1) -> dict[str, float]:
        """After the inner optimizer stepped: launch or apply an outer round when one is due.

        ``tokens``: tokens this inner step trained (``algo.weighting=tokens`` weighs a group's Δ by
        them). Returns the round's ``outer/*`` metrics (empty between rounds).
        """
        if not self._entered or self.result is not None:
            raise RuntimeError("after_inner_step outside the with-block: call it inside `with DiLoCo(...) as outer:`")
        if self.done:
            raise RuntimeError(f"after_inner_step past max_steps={self.max_steps}: loop `while not outer.done:`")
        self.step += 1
        return self._follow(self.sync.after_inner_step(self.step, tokens))

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Normally: stay in the job until every group has finished, then leave θ_g (the job's final
        global model) in the model. After an exception: leave the job at once; the others go on."""
        try:
            if kind is not None:
                return
            if not self.done:
                raise RuntimeError(
                    f"left the DiLoCo block at inner step {self.step} of max_steps={self.max_steps}: the job's "
                    "global model was not reached; loop `while not outer.done:`"
                )
            self.sync.finish(self.step)
            self.sync.load_global_into_local()
            report = self.sync.report()
            end = report.get("end") or {}
            self.result = OuterResult(
                digest=report["digest"],
                rounds=report["rounds"],
                holds_final_model=group_name(self.member.group) in end.get("holders", ()),
                report=report,
            )
            if self.paths is not None and self.member.leader:
                record = {"group": self.member.group, "steps": self.step} | report
                write_json_atomically(self.paths.result(self.member.group), record)
        finally:
            self.sync.close()

    def _follow(self, outcome: OuterOutcome) -> dict[str, float]:
        if outcome.jump_to_step is not None:
            self.step = outcome.jump_to_step
        if outcome.end_training:  # diverged in every group: the job's end follows
            self.step = self.max_steps
        return outcome.metrics


def outer_settings(
    algo: str | AlgoConfig,
    algo_keys: dict[str, Any],
    outer_opt: str | OuterOptConfig | None,
    timeouts: TimeoutsConfig | None,
    max_steps: int,
    warmup_share: float,
    model: nn.Module,
) -> OuterSettings:
    """The outer rounds from ``DiLoCo``'s arguments, each checked as ``run.py`` checks its keys."""
    known = {f.name for f in dataclasses.fields(AlgoConfig)} - {"name"}
    if unknown := sorted(set(algo_keys) - known):
        raise ConfigError(
            f"DiLoCo got {unknown[0]}=..., which is not an AlgoConfig key; its keys: {', '.join(sorted(known))}"
        )
    base = algo if isinstance(algo, AlgoConfig) else AlgoConfig(name=algo)  # type: ignore[arg-type]
    algo_config = dataclasses.replace(base, **algo_keys)
    check(algo_config.name in ALGOS, "algo", algo_config.name, f"must be one of {', '.join(ALGOS)} in your own loop")
    check(isinstance(max_steps, int) and max_steps >= 1, "max_steps", max_steps, "must be an integer >= 1")
    check(0 <= warmup_share <= 1, "warmup_share", warmup_share, "must be in [0, 1] (1: every warm-up as configured)")
    algo_config.validate()
    n_blocks = count_blocks([name for name, _ in model.named_parameters()])
    if algo_config.fragments > 1 and n_blocks == 0:
        raise ConfigError(
            f"algo.fragments={algo_config.fragments}: the model has no numbered blocks (parameters named "
            "like layers.<i>.*) to split into fragments; use fragments=1"
        )
    algo_config.check_fits(n_blocks=max(n_blocks, 1))
    outer = OuterOptConfig(name=outer_opt) if isinstance(outer_opt, str) else outer_opt or OuterOptConfig()
    outer.validate()
    timeouts = timeouts or TimeoutsConfig()
    timeouts.validate()
    return OuterSettings(
        algo=algo_config,
        max_steps=max_steps,
        outer_opt=outer,
        timeouts=timeouts,
        warmup_share=warmup_share,
        n_blocks=n_blocks or None,
    )


def shared_config(settings: OuterSettings) -> dict[str, Any]:
    """What every group must run the same, flat (``algo.sync_every`` -> 50): the lighthouse refuses
    a group whose values differ, naming the keys."""
    steps = {"max_steps": settings.max_steps, "warmup_share": settings.warmup_share}
    return steps | flat_keys({"algo": settings.algo, "outer_opt": settings.outer_opt})


def weights_digest(model: nn.Module) -> str:
    """sha256 of the leader's parameters as wrapped: groups built from different seeds would
    average unrelated models and each hold its own, so the lighthouse refuses a group that starts
    from other weights than the first group's (a restarted group rebuilds the same ones)."""
    return state_digest({name: local_tensor(p).detach() for name, p in model.named_parameters()}).hex()[:32]


def check_fresh_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every group must start from the same θ: wrap before the first ``optimizer.step()``, with an
    optimizer that updates the model's parameters (every one that trains)."""
    stepped = sum(1 for state in optimizer.state.values() if _has_stepped(state))
    if stepped:
        raise ConfigError(
            f"the inner optimizer has stepped already (it holds state for {stepped} parameters): build DiLoCo "
            "before the first optimizer.step(), so every group starts from the same model"
        )
    updated = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missed = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in updated]
    if missed:
        raise ConfigError(
            f"the inner optimizer does not update {len(missed)} of the model's parameters (first: {missed[0]}): "
            "build it from model.parameters() after sharding the model (fully_shard, parallelize_module)"
        )


def _has_stepped(state: Mapping[str, Any]) -> bool:
    """Whether a parameter's optimizer state is past its first step. State created ahead of it (a
    job's AdamW, ``diloco.train.inner_opt.init_adamw_state``; Adagrad's own) is not: a step count
    of 0, or (an optimizer that counts no steps) nothing but zeros."""
    if "step" in state:
        return float(state["step"]) != 0
    return any(torch.is_tensor(v) and bool(v.any()) for v in state.values())


def _given(value: str | None, environ: Mapping[str, str], env: str, name: str, example: str) -> str:
    found = value or environ.get(env, "").strip()
    if not found:
        raise ConfigError(
            f"no {name} for DiLoCo: pass {name}={example!r} or set {env} (start one with "
            "`python run.py role=lighthouse cluster.groups=M cluster.lighthouse.port=PORT`)"
        )
    return found


def _group(group: int | None, environ: Mapping[str, str]) -> int:
    if group is not None:
        check(isinstance(group, int) and group >= 0, "group", group, "must be an integer >= 0")
        return group
    text = environ.get(GROUP_ENV, "").strip()
    if not text.isdigit():
        raise ConfigError(
            f"{GROUP_ENV}={text!r}: DiLoCo needs this process's replica group, an integer >= 0; pass group=G or set {GROUP_ENV}"
        )
    return int(text)


def _device_of(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return torch.device("cpu") if first is None else first.device
