"""``input.kind: text_dataset``: a text corpus streamed, tokenized and packed into rows of ``context`` tokens.

The corpus is a ``datasets`` directory (``save_to_disk``; its ``column``), a ``.jsonl`` file (each line an
object; its ``column`` key) or a folder of ``.txt`` files (each file one document, in sorted path order).
Files are streamed line by line through the gate (an over-long line or invalid UTF-8 is refused naming
file and line); a long ``.txt`` document is handed out in pieces of whole lines (:class:`Continued`), so
``limit_tokens`` stops reading soon after enough tokens are taken. Documents are tokenized without special
tokens, a few at a time; the token streams are joined end to end with the tokenizer's end-of-text token
between two documents, and the joined stream is cut into rows of exactly ``context`` tokens (the last,
partial row is dropped). Only the documents being tokenized and one row are in memory, whatever the
corpus's size.

Example::

    corpus = TextCorpus.open(TextDatasetInput(path="./corpus", context=128))
    for row in packed_rows(tokenizer, corpus.documents(), 128, limit_tokens=10_000):
        ...  # row: int64 [128]
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from surgery.errors import ConfigError
from surgery.files import gate
from surgery.harvest.config import TextDatasetInput
from surgery.lm.text import tokenized

DOCUMENTS_PER_CALL = 64  # documents tokenized in one call of the (Rust, batched) tokenizer
CHARS_PER_CALL = 2**20  # ... or fewer, once they hold this many characters (read no further ahead than this)
PIECE_CHARS = 2**20  # a .txt document longer than this is handed out in pieces of whole lines


class Continued(str):
    """A piece of a document that continues the piece before it (no end-of-text token between them)."""

    __slots__ = ()


class TextCorpus:
    """Where a corpus's documents come from, checked before anything is read at length."""

    def __init__(self, path: Path, kind: str, column: str, split: str | None, files: list[Path]) -> None:
        self.path, self.kind, self.column, self.split, self.files = path, kind, column, split, files
        self.read = 0  # characters of text handed out so far: with ``size``, how far through the corpus we are

    @classmethod
    def open(cls, config: TextDatasetInput) -> TextCorpus:
        """The corpus ``config.path`` names, refused when it is missing, unreadable or lacks ``config.column``."""
        if str(config.path) in ("", "???"):
            raise ConfigError("input.path: name the corpus: a datasets directory, a .jsonl file or a folder of .txt")
        path = gate.config_path(Path(str(config.path)).expanduser(), "input.path")
        if not path.exists():
            raise ConfigError(
                f"input.path: {str(path)!r} does not exist; give a datasets directory (save_to_disk), a .jsonl file"
                " or a folder of .txt files"
            )
        if path.is_file():
            if path.suffix.lower() != ".jsonl":
                raise ConfigError(
                    f"input.path: {str(path)!r} is not a .jsonl file; give a .jsonl file, a datasets directory or a"
                    " folder of .txt files"
                )
            corpus = cls(path, "jsonl", config.column, None, [path])
            corpus._check_jsonl_column()
            return corpus
        if any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            corpus = cls(path, "datasets", config.column, config.split, [])
            corpus._dataset()  # opened once now: a wrong column or split is refused before anything runs
            return corpus
        texts = gate.walk(path, "input.path", ".txt")
        if not texts:
            raise ConfigError(
                f"input.path: {str(path)!r} holds no .txt file and is not a datasets directory; give a folder of"
                " .txt files, a .jsonl file or a datasets directory (save_to_disk)"
            )
        return cls(path, "txt", config.column, None, texts)

    def documents(self) -> Iterator[str]:
        """Every document's text, in order, one at a time."""
        for text in self._texts():
            self.read += len(text)
            yield text

    @property
    def size(self) -> int:
        """Bytes of the corpus on disk (the .jsonl, the .txt files, a datasets directory's Arrow files)."""
        files = self.files if self.kind != "datasets" else gate.walk(self.path, "input.path", ".arrow")
        return sum(f.stat().st_size for f in files)

    def _texts(self) -> Iterator[str]:
        if self.kind == "txt":
            for file in self.files:
                yield from _pieces(gate.text_lines(file, "input.path"))
        elif self.kind == "jsonl":
            yield from self._jsonl()
        else:
            for chunk in self._dataset().iter(batch_size=DOCUMENTS_PER_CALL):
                for text in chunk[self.column]:
                    yield _text(text, f"column {self.column!r}")

    def describe(self) -> dict[str, Any]:
        """What the manifest says about where the corpus came from."""
        return {"path": str(self.path.resolve()), "kind": self.kind, "column": self.column, "split": self.split}

    def _jsonl(self) -> Iterator[str]:
        lines = gate.text_lines(self.path, "input.path")
        try:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line, parse_constant=_no_constant)
                except RecursionError:
                    raise ConfigError(f"input.path: line {number} of {str(self.path)!r} is nested too deeply") from None
                except ValueError as e:
                    raise ConfigError(f"input.path: line {number} of {str(self.path)!r} is not JSON ({e})") from None
                if not isinstance(row, dict) or self.column not in row:
                    keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
                    raise ConfigError(
                        f"input.column: line {number} of {str(self.path)!r} has no {self.column!r} (it has {keys})"
                    )
                yield _text(row[self.column], f"line {number}'s {self.column!r}")
        finally:
            _close(lines)  # a corpus left early (limit_tokens reached) closes its file now

    def _check_jsonl_column(self) -> None:
        """The first line already names the column (a wrong ``column`` is refused before any work)."""
        next(self._jsonl(), None)

    def _dataset(self) -> Any:
        try:
            from datasets import DatasetDict
        except ImportError:
            raise ConfigError("input.path: a datasets directory needs `pip install datasets`") from None
        from surgery.data.hf import check_directory
        from surgery.files.libraries import load_datasets_dir

        check_directory(self.path)
        data = load_datasets_dir(self.path, "input.path")
        if isinstance(data, DatasetDict):
            splits = list(data)
            split = self.split or (splits[0] if len(splits) == 1 else "train")
            if split not in data:
                raise ConfigError(f"input.split: {str(self.path)!r} has splits {', '.join(splits)}; choose one")
            data, self.split = data[split], split
        if self.column not in data.column_names:
            raise ConfigError(
                f"input.column: {str(self.path)!r} has no column {self.column!r}; its columns:"
                f" {', '.join(data.column_names)}"
            )
        return data.select_columns([self.column])


def _close(lines: Iterator[str]) -> None:
    close = getattr(lines, "close", None)  # gate.text_lines is a generator: closing it closes the file
    if close is not None:
        close()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _pieces(lines: Iterator[str]) -> Iterator[str]:
    """A document's text from its lines: whole when short, else pieces of whole lines (each after the first
    :class:`Continued`)."""
    try:
        held: list[str] = []
        size = 0
        first = True
        for line in lines:
            held.append(line)
            size += len(line)
            if size >= PIECE_CHARS:
                text = "".join(held)
                yield text if first else Continued(text)
                held, size, first = [], 0, False
        if held or first:
            text = "".join(held)
            yield text if first else Continued(text)
    finally:
        _close(lines)


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(f"input.column: {what} holds {type(value).__name__} values, not text")
    return value


def end_of_text(tokenizer: Any, model: Any = None) -> int:
    """The token put between two documents: the tokenizer's end-of-text token, else the model config's
    ``eos_token_id`` (GPT-2-style models whose tokenizer file names only ``bos``); refused when neither has one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if isinstance(eos, list) and eos and all(isinstance(e, int) for e in eos):
        eos = eos[0]  # a config listing several end tokens: the first, as generation uses it
    if isinstance(eos, bool) or not isinstance(eos, int):
        raise ConfigError(
            "input.tokenizer: has no end-of-text token (eos_token) to put between documents, and the model's config"
            " names none (eos_token_id); use a tokenizer that defines one"
        )
    return eos


def token_stream(tokenizer: Any, documents: Iterator[str], eos: int | None = None) -> Iterator[list[int]]:
    """Each document's token ids (no special tokens), the end-of-text token before every document but the first."""
    eos = end_of_text(tokenizer) if eos is None else eos
    first = True
    pending: list[str] = []
    chars = 0

    def encoded(texts: list[str]) -> Iterator[list[int]]:
        nonlocal first
        encoded = tokenized(tokenizer, "input.tokenizer", texts, add_special_tokens=False)["input_ids"]
        for text, ids in zip(texts, encoded, strict=True):
            yield ids if first or isinstance(text, Continued) else [eos, *ids]
            first = False

    for text in documents:
        if not text:
            continue
        pending.append(text)
        chars += len(text)
        if len(pending) == DOCUMENTS_PER_CALL or chars >= CHARS_PER_CALL:
            yield from encoded(pending)
            pending, chars = [], 0
    if pending:
        yield from encoded(pending)


def packed_rows(
    tokenizer: Any,
    documents: Iterator[str],
    context: int,
    limit_tokens: int | None = None,
    where: str = "input.path",
    eos: int | None = None,
) -> Iterator[torch.Tensor]:
    """Rows of exactly ``context`` token ids (int64), packed from the documents; at most ``limit_tokens`` tokens.

    A corpus holding no text, or fewer tokens than one row, is refused when the first row is asked for.
    """
    rows_left = None if limit_tokens is None else limit_tokens // context
    buffer: list[int] = []
    seen = 0
    yielded = 0
    for ids in token_stream(tokenizer, documents, eos):
        seen += len(ids)
        buffer.extend(ids)
        start = 0
        while len(buffer) - start >= context:
            if rows_left is not None and yielded >= rows_left:
                return
            row, start = buffer[start : start + context], start + context
            yielded += 1
            yield torch.tensor(row, dtype=torch.int64)
        del buffer[:start]  # once per document: a long document is cut in linear time
        if rows_left is not None and yielded >= rows_left:
            return
    if yielded == 0:
        what = "holds no text" if seen == 0 else f"holds {seen} tokens, fewer than one row of input.context={context}"
        raise ConfigError(f"{where}: the corpus {what}; give more text or a smaller input.context")
