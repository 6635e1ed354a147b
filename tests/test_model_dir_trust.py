"""A model directory from someone else is checked before transformers reads it (SPEC §19, issue 38).

``config.json`` is read through the gate (capped, strict); the model it describes is sized from its
numbers against ``limits.memory_gb`` before anything is built, so a billion layers is refused at once;
under ``safe=true`` a file of the directory that links out is refused; refusals are one line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from surgery.core.limits import SAFE_DEFAULTS, enforced
from surgery.errors import ConfigError
from surgery.lm.load import load_pretrained
from tests.lm_helpers import tiny_gpt2


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gpt2")
    tiny_gpt2(vocab=16, eos=15).save_pretrained(directory)
    return directory


def _copy(saved: Path, into: Path, **config: object) -> Path:
    into.mkdir()
    for file in saved.iterdir():
        (into / file.name).write_bytes(file.read_bytes())
    data = json.loads((saved / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**data, **config}))
    return into


@pytest.mark.parametrize("field", ["n_layer", "num_hidden_layers", "n_embd"])
def test_a_config_declaring_an_enormous_model_is_refused_before_anything_is_built(
    saved: Path, tmp_path: Path, field: str
) -> None:
    huge = _copy(saved, tmp_path / "huge", **{field: 10**9})
    started = time.perf_counter()
    with enforced(SAFE_DEFAULTS), pytest.raises(ConfigError, match=r"^model.path: would need .* GB \(the model config"):
        load_pretrained(huge)
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize("value", [-1, "12", 2.5, True, 2**50])
def test_a_config_number_of_the_wrong_type_or_range_is_one_line(saved: Path, tmp_path: Path, value: object) -> None:
    bad = _copy(saved, tmp_path / "bad", n_layer=value)
    with pytest.raises(ConfigError, match=r"^model.path: config.json has n_layer="):
        load_pretrained(bad)


def test_a_config_json_that_is_not_strict_json_or_too_large_is_one_line(saved: Path, tmp_path: Path) -> None:
    bad = _copy(saved, tmp_path / "nan")
    (bad / "config.json").write_text('{"n_layer": NaN}')
    with pytest.raises(ConfigError, match=r"^model.path: cannot read .*config.json.*NaN"):
        load_pretrained(bad)
    (bad / "config.json").write_text('{"x": "' + "a" * (5 * 2**20) + '"}')
    with pytest.raises(ConfigError, match=r"more than the 4 MiB"):
        load_pretrained(bad)


def test_under_safe_mode_a_file_linked_out_of_the_directory_is_refused(saved: Path, tmp_path: Path) -> None:
    linked = _copy(saved, tmp_path / "linked")
    outside = tmp_path / "elsewhere.safetensors"
    (linked / "model.safetensors").rename(outside)
    (linked / "model.safetensors").symlink_to(outside)
    with enforced(SAFE_DEFAULTS), pytest.raises(ConfigError, match=r"model.safetensors' is a link leading outside"):
        load_pretrained(linked)
    assert load_pretrained(linked) is not None  # your own directory (a hub cache's links) loads outside safe mode
