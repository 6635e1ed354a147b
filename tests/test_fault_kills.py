"""Faults (SPEC §19): a study, harvest or sweep SIGKILLed anywhere and rerun gives the reference's bytes.

A sample of ``scripts/faults`` (its harness, :mod:`scripts.fault_kills`, with smaller jobs and one trial
per kind, killed at a seeded moment; the script runs a hundred trials per kind), and the pieces it
relies on, in-process: a rerun removes the temporary files a killed run left (only ``write_atomic``'s,
never through a link), and a resume file that is a link, cut short or lacking a tensor is refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from scripts.fault_kills import kinds, run_kind, table
from surgery.app.job import run_job
from surgery.errors import ConfigError
from surgery.files.leftovers import remove_temporary_files, temporary_files
from surgery.study.resume import PARTIAL, load_partial
from tests.test_cli import composed

LEFT = ".captures.safetensors.k2x_9abc.tmp"  # what tempfile.mkstemp names write_atomic's temporary file


@pytest.mark.parametrize("kind", ["study", "harvest", "sweep"])
def test_killed_anywhere_and_rerun_gives_the_reference_bytes(kind: str, tmp_path: Path) -> None:
    """One trial: killed at a seeded moment, checked, run again to the end (scripts/faults runs 100 per kind)."""
    tally = run_kind(kinds(sample=True)[kind], tmp_path, 1, seed=0, references=1, say=lambda line: None, times=1)
    assert tally.failures == [], "\n".join([table([tally]), *tally.failures])
    assert tally.kills == 1 and tally.identical == tally.trials == 1


def test_a_rerun_removes_the_temporary_files_a_killed_run_left(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "captures").mkdir(parents=True)
    for name in (LEFT, "captures/.batch-00000.safetensors.abcdefgh.tmp"):
        (run / name).write_bytes(b"half a file")
    (run / "notes.tmp").write_text("the user's")  # not a name write_atomic gives: kept
    report = run_job(composed("+model=mlp", "+actions=capture", "+actions.capture.to=disk", "+input.batches=2"), run)
    assert report["complete"] and report["captures"]["shards"] == ["batch-00000.safetensors", "batch-00001.safetensors"]
    assert temporary_files(run) == [] and (run / "notes.tmp").is_file()


def test_temporary_files_are_looked_for_without_following_links(tmp_path: Path) -> None:
    outside, run = tmp_path / "outside", tmp_path / "run"
    outside.mkdir()
    run.mkdir()
    (outside / LEFT).write_bytes(b"someone else's")
    (run / "link").symlink_to(outside)
    (run / ".hydra").mkdir()
    (run / ".hydra" / LEFT).write_bytes(b"not ours")
    (run / ".rank1").mkdir()
    (run / ".rank1" / LEFT).write_bytes(b"a rank's")
    assert remove_temporary_files(run) == [run / ".rank1" / LEFT]
    assert (outside / LEFT).is_file() and (run / ".hydra" / LEFT).is_file()


def test_a_resume_file_that_is_a_link_or_lacks_a_tensor_is_refused_in_one_line(tmp_path: Path) -> None:
    prints = {"config": "c"}
    path = tmp_path / PARTIAL
    save_file({"values/kl": torch.zeros(2, 1, dtype=torch.float64)}, str(path), metadata=prints)
    with pytest.raises(ConfigError, match=r"^hydra.run.dir: .* has no tensor 'done'") as e:
        load_partial(path, prints, ["kl"], 2, 1)
    assert "\n" not in str(e.value)
    os.replace(path, tmp_path / "elsewhere")
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=r"is a symlink in the run directory"):
        load_partial(path, prints, ["kl"], 2, 1)
    path.unlink()
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # cut short while someone else wrote it
    with pytest.raises(ConfigError, match=r"as \.safetensors \(its header length is not valid\)"):
        load_partial(path, prints, ["kl"], 2, 1)


def test_a_ranks_files_move_over_what_a_killed_torchrun_had_moved(tmp_path: Path) -> None:
    from surgery.dist.run import _move_files

    run, staging = tmp_path / "run", tmp_path / "run" / ".rank0"
    (staging / "plots").mkdir(parents=True)
    (staging / "captures").mkdir()
    (staging / "plots" / "a.png").write_bytes(b"new")
    (staging / "captures" / "batch-00000.safetensors").write_bytes(b"shard")
    (staging / "captures.safetensors").write_bytes(b"captures")
    (run / "plots").mkdir()
    (run / "plots" / "a.png").write_bytes(b"moved before the kill")
    _move_files(staging, run, 0)
    assert (run / "plots" / "a.png").read_bytes() == b"new" and not staging.exists()
    assert (run / "captures" / "rank0-batch-00000.safetensors").read_bytes() == b"shard"
    assert (run / "captures.rank0.safetensors").read_bytes() == b"captures"
