"""A model directory from someone else is checked before transformers reads it (SPEC §19, issue 38).

``config.json`` is read through the gate (capped, strict); the model it describes is sized from its
numbers against ``limits.memory_gb`` before anything is built, so a billion layers is refused at once;
under ``safe=true`` a file of the directory that links out is refused; refusals are one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from surgery.core.limits import SAFE_DEFAULTS, enforced
from surgery.errors import ConfigError
from surgery.lm.load import load_pretrained
from surgery.lm.text import encode_prompts, load_tokenizer
from tests.lm_helpers import tiny_gpt2, word_tokenizer

REPO = Path(__file__).resolve().parents[1]


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


# ---------------------------------------------------------------- +model=hf under safe=true, from the command line


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "surgery", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A start directory holding ``lm/``: a tiny GPT-2 and its word-level tokenizer, as save_pretrained writes them."""
    start = tmp_path_factory.mktemp("start")
    tok = word_tokenizer(["the cat sat on the mat", "a dog ran"])
    tiny_gpt2(len(tok), tok.eos_token_id).save_pretrained(start / "lm")
    tok.save_pretrained(start / "lm")
    return start


def test_a_model_directory_loads_under_safe_mode_to_the_same_logits(with_tokenizer: Path) -> None:
    start = with_tokenizer
    runs = {}
    for safe in ("true", "false"):
        result = _cli("+model=hf", "model.path=lm", f"safe={safe}", f"hydra.run.dir=run-{safe}", cwd=start)
        assert result.returncode == 0, result.stderr
        runs[safe] = load_file(str(start / f"run-{safe}" / "output.safetensors"))["output/logits"]
    model = load_pretrained(start / "lm")
    tok = load_tokenizer(model_path=start / "lm")
    batch = encode_prompts(tok, prompt="The cat sat on the")
    with torch.no_grad():
        by_hand = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(runs["true"], runs["false"])  # the same process kind, the same computation: bit for bit
    torch.testing.assert_close(runs["true"], by_hand, rtol=0, atol=1e-6)  # a child process may use other threads


def test_code_a_model_directory_names_never_runs(with_tokenizer: Path, tmp_path: Path) -> None:
    """``auto_map`` naming a .py file of the directory: refused in one line, safe or not; the file never runs."""
    start = tmp_path
    _copy(with_tokenizer / "lm", start / "lm", model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    marker = tmp_path / "ran"
    (start / "lm" / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    for safe in ("true", "false"):
        result = _cli("+model=hf", "model.path=lm", f"safe={safe}", cwd=start)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("error: model.path: ") and result.stderr.count("\n") == 1, result.stderr
        assert not marker.exists()


def test_a_model_directory_a_config_file_names_outside_the_start_directory_is_refused_under_safe_mode(
    with_tokenizer: Path, tmp_path: Path
) -> None:
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "theirs.yaml").write_text(f"defaults: [hf]\npath: {with_tokenizer / 'lm'}\n")
    result = _cli("--config-dir", str(tmp_path / "conf"), "+model=theirs", "safe=true", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: model.path: "), result.stderr
    assert "refused because safe=true" in result.stderr and result.stderr.count("\n") == 1
    result = _cli("--config-dir", str(tmp_path / "conf"), "+model=theirs", "safe=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
