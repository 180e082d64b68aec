"""Using a trained model: its loss on a corpus (``role=eval``) and text from a prompt (``role=sample``).

Both read the weights a job saved (``model.pt``: the final global model every group agreed
on) on one CPU or GPU, with no process group. The model's shape comes from the run that
trained it; so do the corpus and the windows, but for those the command line sets
(``diloco.launch.trained_run``).
"""

from __future__ import annotations

import json
import math
import pickle
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diloco.config.base import ConfigError, check, to_dict
from diloco.config.data import DataConfig
from diloco.config.sample import SampleConfig
from diloco.files import file_sha256
from diloco.outer.fragments import fragment_parameter_names
from diloco.train.checkpoint import complete_info, enclosing_checkpoint, group_dir, rank_dir, read_rank
from diloco.train.corpus_meta import CorpusTokenizer, load_tokenizer, read_corpus_meta
from diloco.train.data import ByteTokenizer, eval_batches, load_corpus
from diloco.train.device import select_device
from diloco.train.logger import perplexity
from diloco.train.model import Transformer, meta_model
from diloco.train.pipeline import stage_parameter_names
from diloco.train.tp_layout import join_shards, tp_shard_dim
from diloco.train.trainer import Batch, next_token_loss

if TYPE_CHECKING:
    from diloco.config.job import JobConfig


def locate_weights(checkpoint: str | None) -> tuple[Path, Path]:
    """The model ``checkpoint`` names and the run directory that trained it (its config.yaml
    gives the model's shape): a run directory or its model.pt, or a training checkpoint
    (``checkpoints/step-N``: group 0's global model, or one group's folder in it)."""
    check(checkpoint is not None, "checkpoint", checkpoint, "required: a run directory, its model.pt or a checkpoint")
    path = Path(checkpoint)
    if complete_info(group_dir(path, 0)) is not None:
        return group_dir(path, 0), path.parents[1]
    if complete_info(path) is not None:
        return path, path.parents[2]
    weights = path / "model.pt" if path.is_dir() else path
    where = None
    if path.exists() and enclosing_checkpoint(path) not in (None, path):  # a worker's file, its folder
        what = "a folder inside" if path.is_dir() else "a file of"
        raise ConfigError(
            f"checkpoint={checkpoint}: {what} the checkpoint {enclosing_checkpoint(path)}; a checkpoint is a "
            f"folder, so pass checkpoint={enclosing_checkpoint(path)}"
        )
    if not weights.is_file():
        where = f"{path} holds no model.pt" if path.is_dir() else f"{path} does not exist"
    elif problem := _not_a_model_file(weights):
        check_unaltered(weights)  # a run's model.pt changed since: its summary.json says so more exactly
        if weights.name == "model.pt":  # the right file, damaged
            raise ConfigError(
                f"checkpoint={checkpoint}: {weights} is not a loadable model file ({problem}); "
                "use an intact copy of the run's model.pt"
            )
        where = f"{weights} is not a model file ({problem})"
    if where:
        raise ConfigError(
            f"checkpoint={checkpoint}: {where}; point it at a finished run's directory, its model.pt, "
            "or a checkpoint (RUN/checkpoints/step-N)"
        )
    return weights, weights.parent


_ZIP_MAGIC = b"PK\x03\x04"  # a zip archive's first local file header: how torch.load tells its format


def _not_a_model_file(weights: Path) -> str | None:
    """Why ``weights`` cannot be a model.pt, which ``torch.save`` writes as a zip archive, or None.

    Checked before ``torch.load``, whose refusal of anything else is pages of advice to unpickle it."""
    try:
        with open(weights, "rb") as f:
            head = f.read(len(_ZIP_MAGIC))
    except OSError as error:
        return f"cannot read it: {error.strerror or error}"
    if not head:
        return "it is empty"
    if head != _ZIP_MAGIC:
        return "torch.save writes a zip archive, and this file does not start like one"
    return None


def read_weights(weights: Path, trained: JobConfig) -> dict[str, torch.Tensor]:
    """The weights of a model.pt (``weights_only``: tensors, never arbitrary pickled objects), or
    the global model of a group's checkpoint (``trained``: the job that wrote it), its workers'
    shards put back together."""
    if weights.is_dir():
        return checkpoint_global_weights(weights, trained)
    check_unaltered(weights)
    try:
        return torch.load(weights, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        # torch's weights_only refusal is pages that end in advice to unpickle the file: never pass that on
        reason = "damaged, or holds more than tensors" if isinstance(error, pickle.UnpicklingError) else error
        first = str(reason).strip().splitlines()[0] if str(reason).strip() else type(error).__name__
        first = first.split(". ")[0].rstrip(".")  # torch's own first sentence, without its advice
        if "weights_only" in first:
            first = "damaged, or holds more than tensors"
        raise ConfigError(
            f"checkpoint={weights}: not a loadable model file ({first}); use an intact copy of the run's model.pt"
        ) from None


def check_unaltered(weights: Path) -> None:
    """Refuse a model.pt whose bytes differ from those its job recorded (``model_sha256`` in the
    summary.json beside it, where there is one): corrupt or altered since the job ended."""
    summary = weights.parent / "summary.json"
    if weights.name != "model.pt":  # the summary's model_sha256 is of its run's model.pt, no other file
        return
    try:
        recorded = json.loads(summary.read_text()).get("model_sha256")
    except (OSError, ValueError, AttributeError):  # no summary (a copied model.pt), or a summary of no use
        return
    if recorded is not None and file_sha256(weights) != recorded:
        raise ConfigError(
            f"checkpoint={weights}: corrupt or altered since its job wrote it (its sha256 differs from "
            f"model_sha256 in {summary}); use an intact copy of the run's model.pt"
        )


def checkpoint_global_weights(group_folder: Path, trained: JobConfig) -> dict[str, torch.Tensor]:
    """θ_g of a group's checkpoint by parameter name (θ_l for algo=local, which has no θ_g).

    Each worker saved its shard (FSDP2's run of dim 0 of its tensor-parallel piece of its pipeline
    stages' parameters); the shards of each pipeline position are joined in rank order
    (``tp_layout.join_shards``).
    """
    info = complete_info(group_folder) or {}
    tp, parallel = info.get("tp", 1), trained.parallel
    per_position = info.get("workers", 1) // parallel.pp
    weights = {}
    for position in range(parallel.pp):
        if parallel.pp > 1:
            names = stage_parameter_names(trained.model, parallel, position)
        else:
            names = [name for name, _ in meta_model(trained.model).named_parameters()]
        ranks = range(position * per_position, (position + 1) * per_position)
        shards = [read_rank(rank_dir(group_folder, rank)) for rank in ranks]
        for name, key in _saved_keys(names, trained).items():
            weights[name] = join_shards([s[key] for s in shards], tp_shard_dim(name), tp)
    return weights


def _saved_keys(names: list[str], trained: JobConfig) -> dict[str, str]:
    """Under which key a worker holding parameters ``names`` saved each one's θ_g (``WorkerState``)."""
    algo = trained.algo
    if algo.name == "local":
        return {name: f"model.{name}" for name in names}
    if algo.name == "ddp":
        return {name: f"global.0.{i}" for i, name in enumerate(names)}
    parts = fragment_parameter_names(names, trained.model.n_layers, algo.fragments, algo.pattern)
    return {name: f"global.{p}.{i}" for p, part in enumerate(parts) for i, name in enumerate(part)}


def load_model(weights: Path, trained: JobConfig, device: torch.device) -> Transformer:
    """The model ``trained`` (the job that wrote ``weights``) describes, holding ``weights``
    (``read_weights``); weights that are not such a model are refused by name."""
    cfg = trained.model
    state = read_weights(weights, trained)
    model = Transformer(cfg)
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as error:
        first = str(error).strip().splitlines()[0]
        raise ConfigError(
            f"checkpoint={weights}: does not fit a model of dim {cfg.dim}, {cfg.n_layers} layers and vocabulary "
            f"{cfg.vocab_size} ({first}); "
            "is it the model.pt of the run whose config.yaml lies beside it?"
        ) from None
    return model.to(device).eval()


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: list[Batch], device: torch.device) -> float:
    """Mean next-token loss (nats per token) over every token of ``batches``."""
    total = count = 0.0
    for batch in batches:
        n = batch[1].numel()
        total += next_token_loss(model, batch, device).item() * n
        count += n
    return total / count


def text_tokenizer(trained: JobConfig) -> ByteTokenizer | CorpusTokenizer:
    """Sampling reads and writes text through the tokenizer the model was trained with: the one
    ``role=prepare`` saved beside a tokens corpus (named in its tokens.json), or bytes for a model
    of a stdlib or text corpus. A token file without metadata has no tokenizer here."""
    tokenizer = load_tokenizer(trained.data)
    if tokenizer is not None:
        return tokenizer
    check(
        trained.data.corpus != "tokens",
        "data.path",
        trained.data.path,
        "the model was trained on this token file, which has no tokens.json beside it, so no tokenizer to turn "
        "text into its ids and back; prepare the corpus with role=prepare (it saves the tokenizer), or sample a "
        "byte-level model (data=stdlib or data=text)",
    )
    return ByteTokenizer()


def tokenizer_identity(data_cfg: DataConfig) -> str | None:
    """What fixes the meaning of a corpus's ids: "bytes" for stdlib and text, the tokenizer's
    sha256 for a prepared tokens corpus, None for a token file without metadata (unknown)."""
    if data_cfg.corpus != "tokens":
        return "bytes"
    meta = read_corpus_meta(data_cfg)
    return f"tokenizer sha256 {meta.tokenizer.sha256[:12]}... ({meta.tokenizer.source})" if meta else None


def check_same_tokenizer(job: JobConfig, trained: JobConfig) -> None:
    """``role=eval`` scores a model on ids of its own tokenizer, else the loss means nothing: the
    tokenizers' identities where both are known, the vocabularies where one is not."""
    mine, theirs = tokenizer_identity(job.data), tokenizer_identity(trained.data)
    if mine is not None and theirs is not None:
        key, value = ("data.path", job.data.path) if job.data.corpus == "tokens" else ("data.corpus", job.data.corpus)
        theirs_data = f"data=tokens data.path={trained.data.path}" if trained.data.corpus == "tokens" else "data=stdlib"
        check(
            mine == theirs,
            key,
            value,
            f"holds ids of {mine}, but the model was trained on ids of {theirs}; evaluate on a corpus of its "
            f"tokenizer (the model's own: {theirs_data})",
        )
        return
    check(
        trained.model.vocab_size == job.data.vocab_size,
        "data.vocab_size",
        job.data.vocab_size,
        f"differs from the trained model's vocabulary ({trained.model.vocab_size}); "
        "evaluate on a corpus of its tokenizer",
    )


@torch.no_grad()
def generate(
    model: Transformer, prompt: torch.Tensor, cfg: SampleConfig, device: torch.device, vocab_size: int | None = None
) -> torch.Tensor:
    """``cfg.max_new_tokens`` token ids continuing ``prompt`` (1-D), attending to at most
    ``max_seq_len`` tokens back; seeded, so the same call gives the same text. Ids at or past
    ``vocab_size`` (a model's rows beyond its tokenizer's vocabulary) are never drawn."""
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    ids = prompt.to(device).view(1, -1)
    for _ in range(cfg.max_new_tokens):
        logits = model(ids[:, -model.cfg.max_seq_len :])[:, -1, :].float()
        if vocab_size is not None:
            logits[:, vocab_size:] = -math.inf
        if cfg.temperature == 0:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / cfg.temperature
            if cfg.top_k:
                kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, token], dim=1)
    return ids[0, prompt.numel() :].cpu()


def held_out_tokens(job: JobConfig, trained: JobConfig) -> torch.Tensor:
    """The held-out ids ``role=eval`` scores: the data's own; or, for a model trained on a prepared
    corpus scored on text (``data=text`` or ``data=stdlib``), that text's held-out tail encoded with
    the model's tokenizer, so any text can measure a token model."""
    held_out = load_corpus(job.data).val
    if job.data.corpus != "tokens" and (tokenizer := load_tokenizer(trained.data)) is not None:
        # the split may cut a character: its bytes decode to U+FFFD, as a tokenizer would see a torn file
        return tokenizer.encode(held_out.numpy().tobytes().decode("utf-8", errors="replace"))
    check_same_tokenizer(job, trained)
    return held_out


def evaluate_checkpoint(job: JobConfig, weights: Path, trained: JobConfig) -> dict[str, Any]:
    """``role=eval``: the loss of the model in ``weights`` on the held-out windows of ``job``'s data,
    with what was scored (the data, the windows), so a number can be told from another's.

    The windows a group of a training job with the same data and trainer options evaluated
    on (``batch_size`` sequences per worker), so a finished run's final eval loss reproduces.
    """
    held_out = held_out_tokens(job, trained)
    device = select_device(job.cluster.device, 0)
    model = load_model(weights, trained, device)
    t = job.trainer
    sequences = t.batch_size * job.parallel.dp(job.cluster.workers_per_group)
    batches = eval_batches(
        held_out, seq_len=t.seq_len, batch_size=sequences, max_batches=t.eval_batches, worker=0, num_workers=1
    )
    loss = mean_loss(model, batches, device)
    tokens = sum(b[1].numel() for b in batches)
    split = f"held out: the last {job.data.val_fraction:g} of the corpus (data.val_fraction)"
    return {
        "checkpoint": str(weights),
        "eval_loss": loss,
        "eval_ppl": perplexity(loss),
        "tokens": tokens,
        "data": to_dict(job.data) | {"split": split},
        "seq_len": t.seq_len,
        "batches": len(batches),
        "sequences_per_batch": sequences,
    }


def sample_text(job: JobConfig, weights: Path, trained: JobConfig) -> str:
    """``role=sample``: ``job.sample.prompt`` followed by the text the model in ``weights`` continues it with."""
    tokenizer = text_tokenizer(trained)
    device = select_device(job.cluster.device, 0)
    model = load_model(weights, trained, device)
    prompt = tokenizer.encode(job.sample.prompt)
    check(prompt.numel() > 0, "sample.prompt", job.sample.prompt, "encodes to no tokens; give some text")
    continuation = generate(model, prompt, job.sample, device, tokenizer.vocab_size)
    return job.sample.prompt + tokenizer.decode(continuation)
