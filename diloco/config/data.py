"""``data.*``: which corpus a job reads and how its tokens are stored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diloco.config.base import check

TOKEN_DTYPES = ("uint16", "uint32")  # the token file's integer widths by name (diloco/train/data.py maps them to torch)
BYTE_VOCAB_SIZE = 256  # the byte tokenizer's vocabulary: UTF-8 bytes as ids


@dataclass(frozen=True)
class DataConfig:
    """Which corpus to read; ``validate()`` names the key and the fix for a bad value."""

    corpus: Literal["stdlib", "text", "tokens"] = "stdlib"
    path: str | None = None
    # None (conf/data/tokens.yaml): the prepared corpus's tokens.json decides; without one, uint16
    # ids of a 65536 vocabulary (``diloco.config.tokens_meta.resolve_data_section``, run on composing).
    token_dtype: Literal["uint16", "uint32"] | None = "uint16"
    vocab_size: int | None = 256
    val_fraction: float = 0.02

    def validate(self) -> None:
        check(
            self.corpus in ("stdlib", "text", "tokens"),
            "data.corpus",
            self.corpus,
            "must be one of stdlib, text, tokens",
        )
        if self.corpus == "stdlib":
            check(
                self.path is None,
                "data.path",
                self.path,
                "unused when data.corpus=stdlib; drop it, or set data.corpus=text or tokens",
            )
        else:
            what = "a text file or folder" if self.corpus == "text" else "a file of token ids"
            check(
                bool(self.path), "data.path", self.path, f"required when data.corpus={self.corpus}; point it at {what}"
            )
        check(
            self.vocab_size is not None,
            "data.vocab_size",
            self.vocab_size,
            "required for a token file without metadata (tokens.json beside it, written by role=prepare) "
            "read as uint32; set it to the tokenizer's vocabulary size",
        )
        check(self.token_dtype in TOKEN_DTYPES, "data.token_dtype", self.token_dtype, "must be one of uint16, uint32")
        check(
            0.0 < self.val_fraction < 0.5,
            "data.val_fraction",
            self.val_fraction,
            "must be in (0, 0.5); 0.02 keeps 2% of the stream for evaluation",
        )
        if self.corpus in ("stdlib", "text"):
            check(
                self.vocab_size == BYTE_VOCAB_SIZE,
                "data.vocab_size",
                self.vocab_size,
                f"must be 256 when data.corpus={self.corpus} (byte tokenizer)",
            )
        check(self.vocab_size >= 2, "data.vocab_size", self.vocab_size, "must be at least 2")
        if self.token_dtype == "uint16":
            check(
                self.vocab_size <= 65536,
                "data.vocab_size",
                self.vocab_size,
                "must be <= 65536 when data.token_dtype=uint16; use data.token_dtype=uint32",
            )
