"""The two configs of a harvest: the text corpus (``input.kind: text_dataset``) and the run setting ``harvest``."""

from __future__ import annotations

from dataclasses import dataclass, field

from surgery.core.schema import FieldError, one_of

EXCLUDABLE = ("bos", "pad", "eos")  # special tokens whose positions the by-token view skips
STORED_DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclass
class TextDatasetInput:
    """``input.kind: text_dataset``: a corpus streamed, tokenized and packed into rows (surgery/harvest/corpus.py)."""

    kind: str = "text_dataset"
    path: str = "???"  # a datasets directory (save_to_disk), a .jsonl file, or a folder of .txt files
    column: str = "text"  # the text column (datasets) or key (.jsonl); .txt files are read whole
    split: str | None = None  # a DatasetDict's split (null: its only split, or train)
    context: int = 128  # tokens per packed row (at most the model's positions)
    limit_tokens: int | None = None  # at most this many tokens (whole rows); null: the whole corpus
    batch_size: int = 8  # rows per forward pass
    tokenizer: str | None = None  # null: the model's directory (model.path); or a tokenizer dir or tokenizer.json

    def __post_init__(self) -> None:
        one_of("kind", self.kind, ("text_dataset",))
        for key in ("context", "batch_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FieldError(key, f"must be a positive int, got {value!r}")
        if self.limit_tokens is not None and (isinstance(self.limit_tokens, bool) or self.limit_tokens < self.context):
            raise FieldError(
                "limit_tokens", f"{self.limit_tokens!r} is less than one row of input.context={self.context} tokens"
            )


@dataclass
class HarvestSettings:
    """The run setting ``harvest`` of ``mode=harvest`` (docs/activations.md)."""

    sites: list[str] | None = None  # selectors (globs, or @sites) of the modules whose outputs are kept
    exclude: list[str] = field(default_factory=lambda: list(EXCLUDABLE))  # tokens the by-token view skips
    dtype: str | None = None  # how activations are stored: float32 | float16 | bfloat16 | float64; null: the run's
    shard_mb: float = 128  # at most this many MiB per module per shard file (and about that much memory per site)

    def __post_init__(self) -> None:
        if not self.sites:
            raise FieldError("sites", "list the modules to harvest, e.g. harvest.sites=[transformer.h.*]")
        for name in self.exclude:
            one_of("exclude", name, EXCLUDABLE)
        if self.dtype is not None:
            one_of("dtype", self.dtype, STORED_DTYPES)
        if isinstance(self.shard_mb, bool) or not self.shard_mb > 0:
            raise FieldError("shard_mb", f"must be a positive number of MiB, got {self.shard_mb!r}")
