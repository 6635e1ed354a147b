"""Text prompts for language models: a local tokenizer, prompts → one left-padded batch, fit checks.

Prompts are encoded one by one and padded on the left by hand, so a tokenizer without a pad
token (a bare ``tokenizer.json``) needs no change: padding uses the pad token, else the end-of-text
token, else id 0, and padded positions are masked out (``attention_mask`` 0, ``labels`` -100).
Left padding puts every prompt's last token at position -1, where generation continues and
``logit_diff`` reads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from surgery.errors import ConfigError
from surgery.files import gate
from surgery.files.pretrained import from_pretrained
from surgery.lm.load import transformers_offline

IGNORE = -100  # the label PyTorch's cross_entropy and Hugging Face skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
                   "tokenizer.model", "merges.txt", "special_tokens_map.json", "added_tokens.json")  # fmt: skip
TOKENIZER_MAX = 64 * 2**20  # a tokenizer file is a few MiB (a 256k vocabulary's tokenizer.json is ~35 MiB)


def _checked_files(path: Path, where: str) -> None:
    """The tokenizer files the library will read: regular, inside the directory, of a tokenizer's size."""
    files = [path] if path.is_file() else [
        gate.member(path, name, where, "a tokenizer file") for name in TOKENIZER_FILES if (path / name).exists()
    ]  # fmt: skip
    for file in files:
        with gate.open_regular(file, where) as opened:
            size = os.fstat(opened.fileno()).st_size
        if size > TOKENIZER_MAX:
            raise ConfigError(
                f"{where}: {str(file)!r} is {size / 2**20:.3g} MiB, more than the {TOKENIZER_MAX // 2**20} MiB a"
                " tokenizer file may be; refused"
            )


@dataclass(frozen=True)
class TextBatch:
    """Prompts as one batch: ``input_ids`` and ``attention_mask`` ``[prompts, longest]``, padded on the left."""

    prompts: tuple[str, ...]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    lengths: tuple[int, ...]  # tokens per prompt, padding excluded
    decoder_input_ids: torch.Tensor | None = None  # encoder-decoder models: the decoder's prompt (surgery.lm.seq2seq)

    @property
    def labels(self) -> torch.Tensor:
        """``input_ids`` with -100 at padding: the ``y`` the LM metrics read (Hugging Face's ``labels``).

        With a decoder prompt, the decoder's ids: the logits are the decoder's, one row per decoder position.
        """
        if self.decoder_input_ids is not None:
            return self.decoder_input_ids
        return self.input_ids.masked_fill(self.attention_mask == 0, IGNORE)

    def kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword inputs for the model: ``model(**batch.kwargs())``."""
        given = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.decoder_input_ids is not None:
            given["decoder_input_ids"] = self.decoder_input_ids
        return given

    def to(self, device: torch.device | str) -> TextBatch:
        """The same batch on ``device``."""
        decoder = None if self.decoder_input_ids is None else self.decoder_input_ids.to(device)
        return TextBatch(self.prompts, self.input_ids.to(device), self.attention_mask.to(device), self.lengths, decoder)


def tokenized(tokenizer: Any, where: str, text: Any, **options: Any) -> Any:
    """``tokenizer(text, **options)``; a panic inside the native library (a ``tokenizer.json`` whose regex
    backtracks past Oniguruma's retry limit) is one line naming ``where``, its report kept off the terminal."""
    try:
        with gate.stderr_muted():
            return tokenizer(text, **options)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - pyo3's PanicException is a BaseException
        if isinstance(e, Exception) and not type(e).__name__.endswith("PanicException"):
            raise
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConfigError(
            f"{where}: the tokenizer ({type(tokenizer).__name__}) failed inside its native library on this text:"
            f" {first[:200]}; its tokenizer.json (a pre-tokenizer regex?) cannot be used"
        ) from None


def load_tokenizer(
    tokenizer: str | Path | None = None, model_path: str | Path | None = None, where: str = "input.tokenizer"
) -> Any:
    """A tokenizer from a local directory or a ``tokenizer.json`` file; None: the model's directory. Offline.

    >>> tok = load_tokenizer(model_path="./my-gpt2")
    """
    hf = transformers_offline()
    if tokenizer is None or str(tokenizer) in ("", "???"):
        if model_path is None:
            raise ConfigError(f"{where}: no tokenizer given and no model directory to take one from; set {where}=DIR")
        tokenizer, where = model_path, f"{where} (default: model.path)"
    named_by = "model.path" if where.endswith("(default: model.path)") else where  # the key that gave the path
    path = gate.config_path(Path(str(tokenizer)).expanduser(), named_by)
    if not path.exists():
        raise ConfigError(f"{where}: {str(path)!r} does not exist; give a tokenizer directory or a tokenizer.json file")
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        vision = (path / "preprocessor_config.json").is_file()
        raise ConfigError(
            f"{where}: {str(path)!r} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...); give"
            f" {where.split(' ')[0]}=DIR_OR_TOKENIZER_JSON"
            + (", or an image input for this vision model (+input=file input.path=IMAGE.png)" if vision else "")
        )
    if path.is_file() and path.suffix != ".json":
        raise ConfigError(f"{where}: {str(path)!r} is not a tokenizer.json file or a tokenizer directory")
    _checked_files(path, where)
    try:
        if path.is_file():
            return hf.PreTrainedTokenizerFast(tokenizer_file=str(path))
        return from_pretrained(hf.AutoTokenizer, path)
    except ConfigError:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - also a Rust panic (pyo3's PanicException is a BaseException)
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        panic = " (the tokenizers library panicked on it)" if not isinstance(e, Exception) else ""
        raise ConfigError(f"{where}: cannot load a tokenizer from {str(path)!r}{panic}: {first[:300]}") from None


def pad_id(tokenizer: Any) -> int:
    """The id padding uses: the pad token, else the end-of-text token, else 0 (masked out either way)."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            return value
    return 0


def encode_prompts(
    tokenizer: Any, prompt: str | None = None, prompts: Sequence[str] | None = None, where: str = "input"
) -> TextBatch:
    """``prompt`` or ``prompts`` tokenized and padded on the left into one batch.

    >>> batch = encode_prompts(tok, prompts=["The cat sat on the", "A dog ran"])
    >>> model(**batch.kwargs())
    """
    texts = _texts(prompt, prompts, where)
    key = f"{where}.prompt" if prompts is None else f"{where}.prompts"
    encoded: list[list[int]] = []
    for i, text in enumerate(texts):
        at = key if prompts is None else f"{key}[{i}]"
        ids = list(tokenized(tokenizer, at, text)["input_ids"])
        if not ids:
            name = type(tokenizer).__name__
            raise ConfigError(
                f"{at}: {text!r} gives no tokens with this tokenizer ({name}); a directory's tokenizer.json may be"
                f" loaded as another class than was saved (transformers 5 makes a Qwen2 directory's a Qwen2Tokenizer):"
                f" read the file itself with input.tokenizer=DIR/tokenizer.json"
            )
        encoded.append(ids)
    longest = max(len(ids) for ids in encoded)
    filler = pad_id(tokenizer)
    input_ids = torch.tensor([[filler] * (longest - len(ids)) + ids for ids in encoded], dtype=torch.long)
    mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in encoded], dtype=torch.long)
    return TextBatch(tuple(texts), input_ids, mask, tuple(len(ids) for ids in encoded))


def _texts(prompt: str | None, prompts: Sequence[str] | None, where: str) -> list[str]:
    if prompt == "???":  # the input group's required marker: absent when prompts are given
        prompt = None
    if prompt is not None and prompts is not None:
        raise ConfigError(f"{where}.prompts: give {where}.prompt or {where}.prompts, not both")
    if prompts is None:
        if prompt is None:
            raise ConfigError(f'{where}.prompt: a text prompt is required, e.g. {where}.prompt="The cat sat on the"')
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where}.prompt: an empty prompt; give some text")
        return [prompt]
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError(
            f'{where}.prompts: a non-empty list of texts, e.g. ["The cat sat", "A dog ran"]; got {prompts!r}'
        )
    for i, text in enumerate(prompts):
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}.prompts[{i}]: an empty prompt; give some text")
    return [str(t) for t in prompts]


def embedding_rows(model: nn.Module) -> int | None:
    """How many token ids the model embeds (its input embedding's rows, else ``config.vocab_size``)."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def check_vocabulary(
    tokenizer: Any, model: nn.Module, batch: TextBatch | None = None, where: str = "input.tokenizer"
) -> None:
    """Refuse a tokenizer whose ids the model cannot embed (its vocabulary, or this batch, reaches past the rows)."""
    rows = embedding_rows(model)
    if rows is None:
        return
    size = len(tokenizer)
    if size > rows:
        raise ConfigError(
            f"{where}: the tokenizer has {size} tokens but the model embeds only {rows} ids (0..{rows - 1});"
            " use the tokenizer the model was trained with (by default the one in model.path)"
        )
    if batch is not None and int(batch.input_ids.max()) >= rows:
        raise ConfigError(
            f"{where}: the prompts encode to id {int(batch.input_ids.max())}, past the model's {rows} embedding rows;"
            " use the tokenizer the model was trained with"
        )


def require_equal_lengths(batch: TextBatch, source: TextBatch, where: str = "source.prompt") -> None:
    """Refuse a source batch that does not line up token by token with the batch (patching is per position)."""
    if len(source.prompts) != len(batch.prompts):
        raise ConfigError(
            f"{where}: {len(source.prompts)} source prompt(s) for {len(batch.prompts)} input prompt(s);"
            " patching pairs them one to one, so give as many"
        )
    for i, (mine, theirs) in enumerate(zip(batch.lengths, source.lengths)):
        if mine != theirs:
            raise ConfigError(
                f"{where}: {source.prompts[i]!r} is {theirs} tokens and the input prompt {batch.prompts[i]!r} is"
                f" {mine}; patching from a source copies position by position, so the prompts need equal token"
                " lengths (reword one of them)"
            )
