"""Hostile contents of data files (SPEC §19): one line and exit 2, never a traceback; names inside files are data.

Each case crafts a small file the way someone handing over a directory could (a manifest naming
``../../outside``, a ``cfg.json`` with ``k: NaN``, a 2 MiB single-line corpus, a tokenizer regex that
panics in Rust, a YAML alias bomb, 4,000 job directories) and checks the refusal is a ``ConfigError``
whose message starts with the key and fits on one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import surgery.activations
from surgery.errors import ConfigError, SurgeryError


def one_line(error: pytest.ExceptionInfo[BaseException], starts: str, *words: str) -> str:
    """The refusal's message, checked to be one line starting with ``starts`` and holding ``words``."""
    text = str(error.value)
    assert "\n" not in text, text
    assert text.startswith(starts), text
    for word in words:
        assert word in text, (word, text)
    return text


# ---------------------------------------------------------------- 1. surgery.activations.open


def activations(root: Path, manifest: dict[str, Any] | None = None, **shard: torch.Tensor) -> Path:
    """A one-shard dataset (site ``m``, width 2, context 3, two rows), its manifest changed by ``manifest``."""
    base = root / "acts"
    (base / "m").mkdir(parents=True)
    (base / "token_ids").mkdir()
    save_file(
        {"activations": shard.get("activations", torch.ones(2, 3, 2))}, str(base / "m" / "shard-00000.safetensors")
    )
    kept = shard.get("kept", torch.arange(6, dtype=torch.int32))
    ids = torch.zeros(2, 3, dtype=torch.int32)
    save_file({"input_ids": ids, "kept": kept}, str(base / "token_ids" / "shard-00000.safetensors"))
    data = {"format": "surgery.activations/1", "complete": True, "context": 3, "sites": {"m": {"shape": [2]}},
            "shards": [{"rows": 2, "kept": int(kept.numel())}]}  # fmt: skip
    data.update(manifest or {})
    (base / "manifest.json").write_text(json.dumps(data))
    return base


def test_a_well_formed_dataset_reads(tmp_path: Path) -> None:
    data = surgery.activations.open(activations(tmp_path))
    assert len(data) == 6 and data[5]["m"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("manifest", "words"),
    [
        ({"sites": {"../../outside/secret": {"shape": [2]}}}, ("not a plain name",)),
        ({"sites": {"/etc": {"shape": [2]}}}, ("not a plain name",)),
        ({"sites": []}, ("sites",)),
        ({"sites": {"m": {"shape": ["2"]}}}, ("whole number",)),
        ({"context": -3}, ("context", "out of range")),
        ({"context": None}, ("context",)),
        ({"shards": [{"rows": 2}]}, ("kept",)),
        ({"shards": [{"rows": -1, "kept": 0}]}, ("rows", "out of range")),
        ({"shards": [{"rows": 2, "kept": 10**9}]}, ("kept", "out of range")),
        ({"shards": "many"}, ("shards",)),
        ({"complete": "yes"}, ("unfinished",)),
    ],
)
def test_a_hostile_manifest_is_refused_in_one_line(tmp_path: Path, manifest: dict[str, Any], words: tuple) -> None:
    with pytest.raises(ConfigError) as e:
        surgery.activations.open(activations(tmp_path, manifest))
    one_line(e, "activations: ", *words)


def test_a_huge_or_nan_manifest_is_refused_before_parsing(tmp_path: Path) -> None:
    base = activations(tmp_path)
    (base / "manifest.json").write_text('{"context": NaN}')
    with pytest.raises(ConfigError) as e:
        surgery.activations.open(base)
    one_line(e, "activations: ", "NaN")
    (base / "manifest.json").write_text(" " * (5 * 2**20) + "{}")
    with pytest.raises(ConfigError) as e:
        surgery.activations.open(base)
    one_line(e, "activations: ", "MiB")


def test_a_shard_linked_outside_is_refused(tmp_path: Path) -> None:
    base = activations(tmp_path)
    outside = tmp_path / "secret.safetensors"
    os.replace(base / "m" / "shard-00000.safetensors", outside)
    os.symlink(outside, base / "m" / "shard-00000.safetensors")
    with pytest.raises(ConfigError) as e:
        surgery.activations.open(base)
    one_line(e, "activations: ", "leads outside")


def test_a_fifo_shard_is_refused_not_waited_on(tmp_path: Path) -> None:
    base = activations(tmp_path)
    (base / "m" / "shard-00000.safetensors").unlink()
    os.mkfifo(base / "m" / "shard-00000.safetensors")
    data = surgery.activations.open(base)
    with pytest.raises(ConfigError) as e:
        data[0]
    one_line(e, "activations: ", "not a regular file")


def test_a_shard_whose_offsets_pass_its_end_is_refused(tmp_path: Path) -> None:
    base = activations(tmp_path)
    path = base / "m" / "shard-00000.safetensors"
    raw = path.read_bytes()
    (length,) = __import__("struct").unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["activations"]["data_offsets"] = [0, 10**6]
    header["activations"]["shape"] = [2, 3, 10**6 // 24]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
    with pytest.raises(ConfigError) as e:
        surgery.activations.open(base)[0]
    one_line(e, "activations: ", "data_offsets", "out of range")


def test_an_unknown_dtype_and_wrong_shapes_are_refused(tmp_path: Path) -> None:
    base = activations(tmp_path, activations=torch.ones(2, 3, 2, dtype=torch.uint8))
    with pytest.raises(ConfigError) as e:
        surgery.activations.open(base)[0]
    one_line(e, "activations: ", "dtype 'U8'")
    base = activations(tmp_path / "b", activations=torch.ones(2, 3, 5))
    with pytest.raises(ConfigError) as e:
        surgery.activations.open(base)[0]
    one_line(e, "activations: ", "[2, 3, 5]", "[2, 3, 2]")


def test_kept_positions_out_of_range_are_refused(tmp_path: Path) -> None:
    base = activations(tmp_path, kept=torch.tensor([0, 1, 10**6], dtype=torch.int32))
    data = surgery.activations.open(base)
    with pytest.raises(ConfigError) as e:
        data[2]
    one_line(e, "activations: ", "kept positions")


# ---------------------------------------------------------------- 2. SAELens directories (splice)


def load_sae(directory: Path | str) -> Any:
    from surgery.splice.formats import load

    return load(str(directory), "actions.sae.path", None, None, None)


def saelens(root: Path, **cfg: Any) -> Path:
    from tests.splice_helpers import sae_tensors, write_saelens

    return write_saelens(root, sae_tensors(4, 8), **cfg)


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        ({"architecture": []}, ("architecture []", "a JSON array", "a string")),
        ({"architecture": {"a": 1}}, ("architecture", "a JSON object")),
        ({"architecture": "topk", "k": "many"}, ("k 'many'", "a whole number")),
        ({"architecture": "topk", "k": -3}, ("k in", "out of range")),
        ({"architecture": "topk", "activation_fn_kwargs": "k=3"}, ("activation_fn_kwargs",)),
        ({"apply_b_dec_to_input": "no"}, ("apply_b_dec_to_input",)),
        ({"normalize_activations": 3}, ("normalize_activations",)),
        ({"dtype": ["float32"]}, ("dtype",)),
        ({"d_in": 4.5}, ("d_in",)),
        ({"architecture": "x" * 10_000}, ("architecture 'xxx", "...")),
    ],
)
def test_a_hostile_cfg_json_is_refused_in_one_line(tmp_path: Path, cfg: dict[str, Any], words: tuple) -> None:
    with pytest.raises(ConfigError) as e:
        load_sae(saelens(tmp_path / "sae", **cfg))
    text = one_line(e, "actions.sae.path: ", *words)
    assert len(text) < 400


def test_a_cfg_json_with_nan_or_too_large_is_refused_before_parsing(tmp_path: Path) -> None:
    directory = saelens(tmp_path / "sae")
    (directory / "cfg.json").write_text('{"architecture": "topk", "k": NaN}')
    with pytest.raises(ConfigError) as e:
        load_sae(directory)
    one_line(e, "actions.sae.path: ", "NaN")
    (directory / "cfg.json").write_text('{"a": "' + "x" * (5 * 2**20) + '"}')
    with pytest.raises(ConfigError) as e:
        load_sae(directory)
    one_line(e, "actions.sae.path: ", "MiB")


@pytest.mark.parametrize("linked", ["cfg.json", "sae_weights.safetensors"])
def test_files_of_an_sae_directory_linked_outside_are_refused_unread(tmp_path: Path, linked: str) -> None:
    directory = saelens(tmp_path / "sae")
    secret = tmp_path / "secret"
    secret.write_text('{"architecture": "TOP-SECRET-VALUE"}')
    (directory / linked).unlink()
    os.symlink(secret, directory / linked)
    with pytest.raises(ConfigError) as e:
        load_sae(directory)
    text = one_line(e, "actions.sae.path: ", "leads outside")
    assert "TOP-SECRET" not in text


def test_an_sae_directory_linked_outside_is_refused_under_safe_mode(tmp_path: Path) -> None:
    from surgery.files import gate

    start = tmp_path / "start"
    start.mkdir()
    saelens(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", start / "sae")
    with gate.confined(start), pytest.raises(ConfigError) as e:
        load_sae(start / "sae")
    one_line(e, "actions.sae.path: ", "outside the start directory")


# ---------------------------------------------------------------- 3. corpora, streamed


@pytest.fixture(scope="module")
def words() -> Any:
    from tests.lm_helpers import word_tokenizer

    return word_tokenizer(["the cat sat on a mat", "dog ran far"])


def corpus(path: Path) -> Any:
    from surgery.harvest.config import TextDatasetInput
    from surgery.harvest.corpus import TextCorpus

    return TextCorpus.open(TextDatasetInput(path=str(path), context=4))


def rows(tokenizer: Any, opened: Any, limit_tokens: int | None = None) -> list[torch.Tensor]:
    from surgery.harvest.corpus import packed_rows

    return list(packed_rows(tokenizer, opened.documents(), 4, limit_tokens=limit_tokens))


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_single_line_longer_than_a_mib_is_refused_naming_file_and_line(
    tmp_path: Path, words: Any, suffix: str
) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    text = "the cat sat\n" + "dog " * (2**19)
    if suffix == ".txt":
        (folder / "a.txt").write_text(text)
        path = folder
    else:
        path = tmp_path / "c.jsonl"
        path.write_text(json.dumps({"text": "the cat"}) + "\n" + json.dumps({"text": text}) + "\n")
    with pytest.raises(ConfigError) as e:
        rows(words, corpus(path))
    one_line(e, "input.path: ", "line 2", "longer than")


def test_invalid_utf8_is_refused_naming_file_and_line(tmp_path: Path, words: Any) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_bytes(b"the cat sat\non a mat\n\xff\xfe dog\n")
    with pytest.raises(ConfigError) as e:
        rows(words, corpus(tmp_path / "c"))
    one_line(e, "input.path: ", "a.txt", "line 3", "UTF-8")


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces and tokenizer calls of 1,000 characters (1 MiB in the product): the same logic on small files."""
    from surgery.harvest import corpus as module

    monkeypatch.setattr(module, "PIECE_CHARS", 1000)
    monkeypatch.setattr(module, "CHARS_PER_CALL", 1000)


def test_limit_tokens_stops_reading_once_enough_tokens_are_taken(
    tmp_path: Path, words: Any, small_pieces: None
) -> None:
    (tmp_path / "c").mkdir()
    line = b"the cat sat on a mat dog ran far\n"
    body = line * 3000
    (tmp_path / "c" / "a.txt").write_bytes(body + b"\xff broken at the very end\n")
    opened = corpus(tmp_path / "c")
    taken = rows(words, opened, limit_tokens=40)
    assert len(taken) == 10 and opened.read < 1100 < len(body)


def test_the_text_of_a_long_document_is_kept_whole_across_pieces(
    tmp_path: Path, words: Any, small_pieces: None
) -> None:
    (tmp_path / "c").mkdir()
    line = "the cat sat on a mat dog ran far\n"
    (tmp_path / "c" / "a.txt").write_text(line * 300)
    (tmp_path / "c" / "b.txt").write_text("dog ran")
    got = torch.cat(rows(words, corpus(tmp_path / "c")))
    whole = words(line * 300, add_special_tokens=False)["input_ids"] + [words.eos_token_id]
    whole += words("dog ran", add_special_tokens=False)["input_ids"]
    assert got.tolist() == whole[: len(got)] and len(whole) - len(got) < 4


def test_a_txt_linked_outside_the_corpus_is_refused(tmp_path: Path, words: Any) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("the cat sat on a mat")
    (tmp_path / "secret.txt").write_text("TOP-SECRET")
    os.symlink(tmp_path / "secret.txt", tmp_path / "c" / "b.txt")
    with pytest.raises(ConfigError) as e:
        corpus(tmp_path / "c")
    one_line(e, "input.path: ", "b.txt", "outside")


# ---------------------------------------------------------------- 6. replay


BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x]\n"
    + "".join(  # nine levels of nine aliases: 9**9 nodes
        f"{new}: &{new} [{', '.join([f'*{old}'] * 9)}]\n" for old, new in zip("abcdefgh", "bcdefghi")
    )
    + "model: *i\n"
)


def run_dir(root: Path, config: str, report: str = '{"fingerprints": {"output": "abc"}}') -> Path:
    (root / "run" / ".hydra").mkdir(parents=True)
    (root / "run" / ".hydra" / "config.yaml").write_text(config)
    (root / "run" / "report.json").write_text(report)
    return root / "run"


def test_replay_refuses_a_yaml_alias_bomb_at_once(tmp_path: Path) -> None:
    from surgery.app.replay import load_run

    with pytest.raises(SurgeryError) as e:
        load_run(run_dir(tmp_path, BOMB))
    one_line(e, str(tmp_path / "run" / ".hydra" / "config.yaml"), "refused YAML", "aliases")


@pytest.mark.parametrize(
    "report",
    ['{"fingerprints": {"output": "abc"}, "environment": []}', '{"fingerprints": {"output": [1]}}',
     '{"fingerprints": {"output": NaN}}', "[1, 2]"],
)  # fmt: skip
def test_replay_refuses_a_hostile_report_in_one_line(tmp_path: Path, report: str) -> None:
    from surgery.app.replay import load_run

    with pytest.raises(SurgeryError) as e:
        load_run(run_dir(tmp_path, "model: {x: 1}\n", report))
    one_line(e, str(tmp_path / "run" / "report.json"))


# ---------------------------------------------------------------- 8. a _target_ refused under safe mode


def test_every_shipped_model_but_hf_passes_the_composed_target_check() -> None:
    from hydra import compose, initialize_config_dir

    from surgery.safe.hydra_tree import check_job_targets

    conf = Path(__file__).resolve().parent.parent / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for name in ("cnn", "gpt2_tiny", "mlp", "functions"):
            check_job_targets(compose("config", overrides=[f"+model={name}", "safe=true"]))
        evil = compose("config", overrides=["+model=cnn", "+model.inner._target_=os.system", "safe=true"])
        with pytest.raises(ConfigError) as e:
            check_job_targets(evil)
        one_line(e, "model.inner._target_: 'os.system' is not on the safe-mode allowlist")


# ---------------------------------------------------------------- 7. sweep summaries


def sweep_dir(root: Path, rows: int, cols: int) -> Path:
    """A crafted sweep: a job per (a, b) with one metric, as Hydra's -m writes it."""
    for n in range(rows * cols):
        job = root / "sweep" / str(n)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- a={n // cols}\n- b={n % cols}\n")
        report = {"mode": "run", "metrics": {"surgered": {"acc": n / 10}, "unmodified": {"acc": 1.0}}}
        (job / "report.json").write_text(json.dumps(report))
    return root / "sweep"


def test_a_heatmap_too_large_is_not_drawn_and_the_csv_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from surgery.app import sweep, sweep_plots

    assert sweep_plots.too_large(1, cells=4000 * 4000) is not None  # 4,000 crafted jobs: refused from the count
    assert sweep_plots.heatmap_cells({str(i): str(i) for i in range(4000)}, {str(i): str(i) for i in range(4000)})
    monkeypatch.setattr(sweep_plots, "MAX_CELLS", 10)  # the same bound, on 12 jobs
    root = sweep_dir(tmp_path, 4, 3)
    notes: list[str] = []
    written = sweep.write_summary(root, notes=notes)
    assert [p.name for p in written] == ["summary.csv", "summary.md"] and not (root / "summary.png").exists()
    assert len((root / "summary.csv").read_text().splitlines()) == 13
    assert notes == ["summary.png not drawn: a heatmap of 12 cells, more than 10; summary.csv holds every value"]
    assert "Note: summary.png not drawn" in (root / "summary.md").read_text()


@pytest.mark.parametrize("report", ['{"mode": "run", "x": NaN}', "[" * 100_000, "{" + " " * (65 * 2**20) + "}"])
def test_a_hostile_report_json_is_one_line(tmp_path: Path, report: str) -> None:
    from surgery.app import sweep
    from surgery.errors import SweepError

    root = sweep_dir(tmp_path, 1, 2)
    (root / "1" / "report.json").write_text(report)
    with pytest.raises(SweepError) as e:
        sweep.collect(root)
    one_line(e, str(root / "1" / "report.json"))


def test_a_job_directory_linked_from_outside_is_refused(tmp_path: Path) -> None:
    from surgery.app import sweep
    from surgery.errors import SweepError

    root = sweep_dir(tmp_path, 1, 1)
    sweep_dir(tmp_path / "other", 1, 1)
    os.symlink(tmp_path / "other" / "sweep" / "0", root / "1")
    with pytest.raises(SweepError) as e:
        sweep.collect(root)
    one_line(e, str(root), "leads outside")


# ---------------------------------------------------------------- 4. tokenizers


class PanicException(BaseException):  # noqa: N818 - pyo3's name for a Rust panic surfacing in Python
    """What pyo3 raises when Rust code panics (a BaseException, not an Exception)."""


def test_a_tokenizer_that_panics_in_rust_is_one_line_naming_the_file(
    tmp_path: Path, words: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    from surgery.lm.text import load_tokenizer

    words.save_pretrained(tmp_path / "tok")
    file = tmp_path / "tok" / "tokenizer.json"

    def panics(*args: Any, **kwargs: Any) -> Any:
        raise PanicException("called `Result::unwrap()` on an `Err` value: regex\nstack backtrace:\n  0: ...")

    monkeypatch.setattr(transformers, "PreTrainedTokenizerFast", panics)
    with pytest.raises(ConfigError) as e:
        load_tokenizer(file)
    one_line(e, "input.tokenizer: ", str(file), "panicked")


def test_a_tokenizer_linked_outside_or_a_fifo_is_refused(tmp_path: Path, words: Any) -> None:
    from surgery.files import gate
    from surgery.lm.text import load_tokenizer

    words.save_pretrained(tmp_path / "tok")
    start = tmp_path / "start"
    start.mkdir()
    os.symlink(tmp_path / "tok" / "tokenizer.json", start / "tokenizer.json")
    with gate.confined(start), pytest.raises(ConfigError) as e:
        load_tokenizer(start / "tokenizer.json")
    one_line(e, "input.tokenizer: ", "outside the start directory")
    (tmp_path / "tok" / "vocab.json").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "tok" / "vocab.json")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(tmp_path / "tok")
    one_line(e, "input.tokenizer: ", "not a regular file")


# ---------------------------------------------------------------- through the command line: exit 2, one line


def test_replay_of_an_alias_bomb_exits_2_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    directory = run_dir(tmp_path, BOMB)
    result = subprocess.run([sys.executable, "-m", "surgery.replay", str(directory)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "refused YAML" in lines[0], result.stderr
