"""The ``vectors:`` block of a run (SPEC §20), checked before any work: one entry per named vector.

```yaml
vectors:
  love_hate:
    site: "@resid_post.3"              # any selector that resolves to one module
    plus: {prompts: ["I love", "Love is"]}
    minus: {prompts: ["I hate", "Hate is"]}   # optional: without it the vector is plus's mean
    pos: -1                            # -1: each prompt's last token; 0: its first; mean: every token
```
A side is ``{prompts: [...]}`` or ``{file: PATH, key: KEY}`` (a ``[d]`` tensor is that side's mean,
``[n, d]`` rows are averaged).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from surgery.errors import ConfigError, did_you_mean

VECTOR_KEYS = ("site", "plus", "minus", "pos")
SIDE_KEYS = ("prompts", "file", "key", "data", "column", "limit")
DATA_LIMIT = 256  # texts a data side reads by default (they run as one batch)


@dataclass(frozen=True)
class Side:
    """One side of a contrast: prompts run through the model, or a tensor file's mean (or rows to average)."""

    prompts: tuple[str, ...] | None = None
    file: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class VectorSpec:
    """One entry of ``vectors:``, checked."""

    name: str
    site: str | None  # where prompts are read; a vector of files alone needs none
    plus: Side
    minus: Side | None
    pos: int | str  # an int (negative: from each prompt's last real token; else from its first) or "mean"


def parse_vectors(block: Any, where: str = "vectors") -> list[VectorSpec]:
    """Every entry of a ``vectors:`` block (null or ``{}``: none), each checked; one line naming the key if not."""
    if isinstance(block, DictConfig):
        block = OmegaConf.to_container(block, resolve=True)
    if block is None:
        return []
    if not isinstance(block, Mapping):
        raise ConfigError(f"{where}: a mapping of named vectors, e.g. {{steer: {{site: '@resid_post.1', plus: ...,"
                          f" minus: ...}}}}; got {type(block).__name__}")  # fmt: skip
    return [_vector(str(name), node, f"{where}.{name}") for name, node in block.items()]


def _vector(name: str, node: Any, where: str) -> VectorSpec:
    if not isinstance(node, Mapping):
        raise ConfigError(f"{where}: a mapping with site, plus, minus and pos; got {node!r}")
    _known(node, VECTOR_KEYS, where)
    if node.get("plus") is None:
        raise ConfigError(f"{where}.plus: required: {{prompts: [...]}} or {{file: PATH, key: KEY}}")
    plus = _side(node["plus"], f"{where}.plus")
    minus = None if node.get("minus") is None else _side(node["minus"], f"{where}.minus")
    site = node.get("site")
    prompts = plus.prompts is not None or (minus is not None and minus.prompts is not None)
    if (prompts or site is not None) and (not isinstance(site, str) or not site):
        raise ConfigError(f"{where}.site: where prompts are read, a selector of one module, e.g. '@resid_post.3';"
                          f" got {site!r}")  # fmt: skip
    pos = node.get("pos", -1)
    if pos != "mean" and (isinstance(pos, bool) or not isinstance(pos, int)):
        raise ConfigError(f"{where}.pos: a position (an int; -1 is each prompt's last token) or 'mean'; got {pos!r}")
    return VectorSpec(name, site, plus, minus, pos)


def _side(node: Any, where: str) -> Side:
    if not isinstance(node, Mapping):
        raise ConfigError(f"{where}: {{prompts: [...]}} or {{file: PATH, key: KEY}}; got {node!r}")
    _known(node, SIDE_KEYS, where)
    prompts, file, key = node.get("prompts"), node.get("file"), node.get("key")
    if node.get("data") is not None:
        if prompts is not None or file is not None:
            raise ConfigError(f"{where}.data: give prompts, file or data, one of them")
        return Side(prompts=_data_texts(node, f"{where}"))
    if (prompts is None) == (file is None):
        raise ConfigError(f"{where}: give prompts or file (with key), one of them")
    if file is not None:
        if not isinstance(file, str) or not isinstance(key, str):
            raise ConfigError(f"{where}.key: a file side names the tensor to read: {{file: PATH, key: KEY}}")
        return Side(file=file, key=key)
    if key is not None:
        raise ConfigError(f"{where}.key: goes with file; prompts take no key")
    if isinstance(prompts, str) or not isinstance(prompts, list) or not prompts:
        raise ConfigError(f"{where}.prompts: a non-empty list of texts; got {prompts!r}")
    for i, text in enumerate(prompts):
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}.prompts[{i}]: an empty prompt; give some text")
    return Side(prompts=tuple(prompts))


def _data_texts(node: Mapping, where: str) -> tuple[str, ...]:
    """A data side's texts: a ``.jsonl`` file's ``column`` (default ``text``), a ``.txt`` file's lines, or a folder's
    ``.txt`` files (one text each), at most ``limit``; read through the gate (streamed, UTF-8, no links out)."""
    import json
    from pathlib import Path

    from surgery.files import gate

    column, limit = node.get("column", "text"), node.get("limit", DATA_LIMIT)
    if not isinstance(column, str):
        raise ConfigError(f"{where}.column: the name of a .jsonl file's text field; got {column!r}")
    limit = gate.whole(limit, f"{where}.limit", 1, 100_000)
    path = gate.config_path(str(node["data"]), f"{where}.data")
    texts: list[str] = []
    if path.is_dir():
        for file in gate.walk(path, f"{where}.data", ".txt")[:limit]:
            texts.append(gate.read_text(file, f"{where}.data", gate.LINE_MAX, "one text of a data side").strip())
    elif path.suffix == ".jsonl":
        for number, line in enumerate(gate.text_lines(path, f"{where}.data"), 1):
            if len(texts) >= limit:
                break
            if line.strip():
                try:
                    value = json.loads(line).get(column)
                except (ValueError, AttributeError):
                    raise ConfigError(f"{where}.data: {str(path)!r} line {number} is not a JSON object") from None
                if not isinstance(value, str):
                    raise ConfigError(f"{where}.column: {str(path)!r} line {number} has no text {column!r}")
                texts.append(value)
    elif path.suffix == ".txt":
        for line in gate.text_lines(path, f"{where}.data"):
            if len(texts) >= limit:
                break
            texts.append(line.rstrip("\n"))
    else:
        raise ConfigError(f"{where}.data: a .jsonl file, a .txt file (a text a line) or a folder of .txt; got"
                          f" {str(Path(path))!r}")  # fmt: skip
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ConfigError(f"{where}.data: {str(path)!r} holds no text")
    return tuple(texts)


def _known(node: Mapping, keys: tuple[str, ...], where: str) -> None:
    for key in node:
        if key not in keys:
            raise ConfigError(
                f"{where}.{key}: unknown key.{did_you_mean(str(key), keys)} Keys here: {', '.join(keys)}."
            )
