"""The gate checks the path that is used, not the text a config held (SPEC §19, issue 38).

Each class of escape the red team found: a study placeholder filled with ``../outside``, an interpolation
that makes ``..``, a link inside the start directory pointing out, a run directory whose ``plots/`` is a
link out. Each is refused in one line with exit 2 and nothing is read or written outside; the gate's
own doors (regular files only, names from data files, walks, writes) are checked in-process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from surgery.errors import ConfigError
from surgery.files import gate
from surgery.files.write import write_text
from tests.test_cli import cli

PATCH = "{kind: modify_output, select: classifier.1, op: add, from: {file: FILE, key: k}}"


def _layout(tmp_path: Path) -> tuple[Path, Path]:
    """``start/`` (where the run starts, with a user config dir) and ``outside/`` holding a tensor file."""
    start, outside = tmp_path / "start", tmp_path / "outside"
    (start / "conf" / "experiment").mkdir(parents=True)
    outside.mkdir()
    save_file({"k": torch.ones(10)}, str(outside / "w.safetensors"))
    return start, outside


def _experiment(start: Path, body: str) -> None:
    (start / "conf" / "experiment" / "x.yaml").write_text("# @package _global_\n" + body)


def _refused(result, key: str, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert lines[0].removeprefix("error: ").split("}: ")[-1].startswith(f"{key}: "), lines[0]  # after a cell's name
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def _run(start: Path, *args: str):
    return cli("--config-dir", str(start / "conf"), "+model=cnn", "+input=random", "+experiment=x", *args, cwd=start)


def test_a_study_placeholder_filled_with_a_path_outside_is_refused(tmp_path: Path) -> None:
    start, _ = _layout(tmp_path)
    patch = PATCH.replace("FILE", "'{f}'")
    _experiment(
        start, f"study: {{grid: {{f: ['../outside/w.safetensors']}}, metrics: [kl]}}\nactions: {{p: {patch}}}\n"
    )
    _refused(_run(start, "safe=true"), "actions.p.from.file", "'../outside/w.safetensors'", "outside the start")


def test_an_interpolation_that_makes_dotdot_is_checked_after_it_resolves(tmp_path: Path) -> None:
    start, _ = _layout(tmp_path)
    _experiment(start, "actions: {p: " + PATCH.replace("FILE", "'${now:..}/outside/w.safetensors'") + "}\n")
    _refused(_run(start, "safe=true"), "actions.p.from.file", "outside the start directory")


def test_a_link_inside_the_start_directory_leading_out_is_refused_and_typed_paths_are_the_users(
    tmp_path: Path,
) -> None:
    start, outside = _layout(tmp_path)
    (start / "w.safetensors").symlink_to(outside / "w.safetensors")
    _experiment(start, f"actions: {{p: {PATCH.replace('FILE', 'w.safetensors')}}}\n")
    _refused(_run(start, "safe=true"), "actions.p.from.file", "a symlink to", "type it on the command line")
    typed = _run(start, "safe=true", "actions.p.from.file=w.safetensors")  # the printed suggestion works
    assert typed.returncode == 0, typed.stderr


def test_a_run_directory_whose_plots_folder_links_out_is_refused_and_nothing_is_written_there(
    tmp_path: Path,
) -> None:
    start, outside = _layout(tmp_path)
    (start / "run").mkdir()
    (start / "run" / "plots").symlink_to(outside)
    _experiment(start, "actions: {c: {kind: capture, select: block3, plot: true}}\n")
    result = _run(start, "hydra.run.dir=run")
    _refused(result, "c__block3__output.png", "plots' is a symlink in the run directory", "never writes through a link")
    assert sorted(p.name for p in outside.iterdir()) == ["w.safetensors"]


# ---------------------------------------------------------------- the doors, in-process


def test_only_regular_files_are_read_and_a_fifo_never_blocks(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ConfigError, match=r"^input.path: .* not a regular file"):
        gate.read_bytes(tmp_path / "pipe", "input.path")
    with pytest.raises(ConfigError, match=r"^input.path: .* is a directory"):
        gate.read_bytes(tmp_path, "input.path")


def test_metadata_is_capped_before_it_is_parsed_and_nan_is_not_a_number(tmp_path: Path) -> None:
    (tmp_path / "cfg.json").write_text('{"d_in": ' + " " * (gate.METADATA_MAX + 1) + "1}")
    with pytest.raises(ConfigError, match=r"^module.path: .* MiB, more than the 4 MiB"):
        gate.read_json(tmp_path / "cfg.json", "module.path")
    (tmp_path / "cfg.json").write_text('{"k": NaN}')
    with pytest.raises(ConfigError, match=r"^module.path: cannot read .* \(NaN is not a number JSON allows\)"):
        gate.read_json(tmp_path / "cfg.json", "module.path")
    (tmp_path / "cfg.json").write_text("[" * 100_000)
    with pytest.raises(ConfigError, match=r"^module.path: .*(nested too deeply|cannot read)"):
        gate.read_json(tmp_path / "cfg.json", "module.path")


@pytest.mark.parametrize("name", ["../secret", "/etc/passwd", "a/../../b", "", None, 3, "~/x", "a\x00b"])
def test_a_name_inside_a_data_file_is_never_a_path(tmp_path: Path, name: object) -> None:
    with pytest.raises(ConfigError, match=r"^manifest.shards: "):
        gate.member(tmp_path, name, "manifest.shards", "a shard")


def test_a_name_that_is_a_link_out_is_refused_one_that_stays_inside_is_read(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "secret").write_text("s3cr3t")
    (tmp_path / "data" / "out").symlink_to(tmp_path / "secret")
    (tmp_path / "data" / "real").write_text("x")
    (tmp_path / "data" / "in").symlink_to(tmp_path / "data" / "real")
    with pytest.raises(ConfigError, match=r"leads outside") as caught:
        gate.member(tmp_path / "data", "out", "manifest.shards")
    assert "s3cr3t" not in str(caught.value)
    assert gate.member(tmp_path / "data", "in", "manifest.shards") == (tmp_path / "data" / "real").resolve()


def test_a_walk_never_leaves_its_directory(tmp_path: Path) -> None:
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("a")
    (tmp_path / "corpus" / "sub" / "b.txt").write_text("b")
    assert [p.name for p in gate.walk(tmp_path / "corpus", "input.path", ".txt")] == ["a.txt", "b.txt"]
    (tmp_path / "other").mkdir()
    (tmp_path / "corpus" / "far").symlink_to(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"far' is a link leading outside"):
        gate.walk(tmp_path / "corpus", "input.path", ".txt")


def test_writes_refuse_a_link_anywhere_below_the_run_directory(tmp_path: Path) -> None:
    run, far = tmp_path / "run", tmp_path / "far"
    (run / "a").mkdir(parents=True)
    far.mkdir()
    (run / "a" / "b").symlink_to(far)
    (run / "report.json").symlink_to(far / "report.json")
    with gate.writing_into(run):
        for target in (run / "a" / "b" / "c" / "x.txt", run / "report.json"):
            with pytest.raises(ConfigError, match="symlink in the run directory"):
                write_text(target, "x")
        write_text(run / "a" / "new" / "x.txt", "ok")
    assert not list(far.iterdir())
    assert (run / "a" / "new" / "x.txt").read_text() == "ok"


def test_a_config_path_is_checked_only_under_confinement_and_typed_keys_are_the_users(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    assert gate.config_path("../x", "input.path") == Path("../x")  # the Python API: the caller's own path
    with gate.confined(tmp_path / "in"):
        with pytest.raises(ConfigError, match=r"^input.path: '.*in/\.\./x' is outside the start directory"):
            gate.config_path(tmp_path / "in" / ".." / "x", "input.path")
    with gate.confined(tmp_path / "in", {"input.path", "model"}):
        gate.config_path("../x", "input.path")
        with pytest.raises(ConfigError, match=r"^model.checkpoint: "):  # choosing a group's file vouches for nothing
            gate.config_path("../x", "model.checkpoint")


@pytest.mark.parametrize(("link", "key"), [(".hydra", "hydra.output_subdir"), ("surgery.log", "hydra.job_logging")])
def test_hydras_own_files_are_not_written_through_a_link_in_a_resumed_run_directory(
    tmp_path: Path, link: str, key: str
) -> None:
    start, outside = _layout(tmp_path)
    (start / "run").mkdir()
    (start / "run" / link).symlink_to(outside if link == ".hydra" else outside / "w.safetensors")
    before = (outside / "w.safetensors").read_bytes()
    result = cli("+model=cnn", "+input=random", "hydra.run.dir=run", cwd=start)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {key}"), result.stderr
    assert "is a symlink in the run directory" in result.stderr and len(result.stderr.splitlines()) == 1
    assert sorted(p.name for p in outside.iterdir()) == ["w.safetensors"]
    assert (outside / "w.safetensors").read_bytes() == before


def test_the_packages_own_files_are_the_programs_not_a_configs(tmp_path: Path) -> None:
    """+model=induction_lm under safe=true reads its shipped weights, wherever the run starts."""
    from surgery.models.induction import WEIGHTS

    with gate.confined(tmp_path):
        assert gate.config_path(WEIGHTS, "model.path") == WEIGHTS
