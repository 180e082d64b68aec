"""The few lines a local job prints at its start: what it trains, how its groups sync and how
much they send, the tokens it reads, its warm-ups and its rules for the number of groups, and
where to watch it.

A new user learns here, before the first step, what the composed presets and overrides made
of the job: every number is derived from the ``JobConfig`` the workers get.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from diloco.config.algo import AlgoConfig
from diloco.config.base import to_dict
from diloco.config.group_rules import group_rules_line
from diloco.config.job import JobConfig
from diloco.config.model import ModelConfig
from diloco.config.warmups import last_window_line, planned_windows, warmup_line
from diloco.launch.compose import CONF_DIR, load_saved_config
from diloco.outer.codecs import Dense, codec_for

# Fields a preset does not decide: the data sets the vocabulary, model.init_from a checkpoint's shape.
NOT_SHAPE = ("vocab_size", "init_from")


def header_lines(
    job: JobConfig, n_params: int, status_url: str | None, run_dir: Path, memory_line: str | None = None
) -> list[str]:
    """The job's header, one fact per line (``status_url`` None: no lighthouse, so no page); ``memory_line``:
    what the processes' environment made of their memory (``diloco.huge_pages.huge_pages_line``)."""
    lines = [model_line(job, n_params), algo_line(job, n_params), tokens_line(job)]
    lines += [line for line in (warmup_line(job), group_rules_line(job), memory_line) if line]
    page = f", status page {status_url}/" if status_url else ""
    return [*lines, f"watch: run directory {run_dir}{page}"]  # the page last: tools read its URL off the end


def model_line(job: JobConfig, n_params: int) -> str:
    """``model: tiny (2 layers, dim 64, 4 heads, vocab 256), 131,392 parameters; 2 groups x 2
    workers (dp 2)``: the preset or checkpoint, the shape, and each group's pp x dp x tp mesh."""
    m = job.model
    shape = f"{m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, vocab {m.vocab_size}"
    name = m.init_from or model_preset(m)
    mesh = [("pp", job.parallel.pp), ("dp", job.parallel.dp(job.cluster.workers_per_group)), ("tp", job.parallel.tp)]
    layout = " x ".join(f"{dim} {size}" for dim, size in mesh if size > 1 or dim == "dp")
    groups = f"{_count(job.cluster.groups, 'group')} x {_count(job.cluster.workers_per_group, 'worker')}"
    described = f"{name} ({shape})" if name else shape
    return f"model: {described}, {n_params:,} parameters; {groups} ({layout})"


def model_preset(model: ModelConfig) -> str | None:
    """The ``conf/model`` preset whose shape ``model`` has, so the header names what was chosen;
    None for a shape of one's own (a preset with a key overridden). A file of ``conf/model``
    holding more than ``model.*`` keys names no shape."""
    keys = to_dict(ModelConfig()).keys()
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        preset = load_saved_config(path)
        if preset.keys() <= keys and _shape(replace(ModelConfig(), **preset)) == _shape(model):
            return path.stem
    return None


def _shape(model: ModelConfig) -> dict[str, object]:
    return {key: value for key, value in to_dict(model).items() if key not in NOT_SHAPE}


def algo_line(job: JobConfig, n_params: int) -> str:
    """How the groups sync and what each sends per round: ``algo: diloco H=50 P=1 τ=0, payload
    fp32, inner adamw lr 0.003, outer nesterov lr 0.7; 18 rounds of ~526 kB per group``."""
    algo = job.algo
    inner = f"inner {job.inner_opt.name} lr {job.inner_opt.lr:g}"
    if algo.name == "local":
        return f"algo: local, every group trains alone (no sync; the no-communication baseline), {inner}"
    if algo.name == "ddp":
        gradients = _size(Dense().nbytes(n_params))
        return (
            f"algo: ddp, the gradients all-reduced every step, {inner}: {job.trainer.max_steps} rounds of "
            f"~{gradients} per group"
        )
    payload, bytes_per_model = payload_of(algo, n_params)
    rounds = planned_windows(job) * algo.fragments
    auto = " (algo.auto re-picks τ and the format each round)" if algo.auto else ""
    last = last_window_line(job)
    return (
        f"algo: {algo.name} H={algo.sync_every} P={algo.fragments} τ={algo.delay}, payload {payload}{auto}, "
        f"{inner}, outer {job.outer_opt.name} lr {job.outer_opt.lr:g}; "
        f"{rounds} rounds of ~{_size(bytes_per_model / algo.fragments)} per group" + (f"; {last}" if last else "")
    )


def payload_of(algo: AlgoConfig, n_params: int) -> tuple[str, int]:
    """The payload's codec, and its bytes for the whole model: a round sends one fragment's share."""
    codec = codec_for(algo)
    return codec.name, codec.nbytes(n_params)


def tokens_line(job: JobConfig) -> str:
    """``tokens: 2,048 per step per group (batch 8 x dp 2 x accum 1 x seq 128), 4,096 per step;
    2,048,000 in 500 steps``."""
    t = job.trainer
    dp = job.parallel.dp(job.cluster.workers_per_group)
    per_group = group_step_tokens(job)
    per_job = per_group * job.cluster.groups
    return (
        f"tokens: {per_group:,} per step per group (batch {t.batch_size} x dp {dp} x accum {t.grad_accum} "
        f"x seq {t.seq_len}), {per_job:,} per step; {per_job * t.max_steps:,} in {t.max_steps} steps"
    )


def group_step_tokens(job: JobConfig) -> int:
    """Tokens one group trains per inner step, the same in every group: summary.json turns a group's tokens
    into steps with it (tokens_seen over a healed group's last step would count the steps it jumped over)."""
    t = job.trainer
    return t.batch_size * job.parallel.dp(job.cluster.workers_per_group) * t.grad_accum * t.seq_len


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _size(n_bytes: float) -> str:
    """``526 kB``, ``76.4 MB``: three significant digits, decimal units (as link speeds are)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n_bytes < 999.5:
            return f"{n_bytes:.3g} {unit}"
        n_bytes /= 1000
    return f"{n_bytes:.3g} TB"
