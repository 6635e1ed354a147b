"""Under safe=true a path a config file names stays inside the start directory; one typed on the command line is
the user's own. Replay checks every path of the saved config."""

from __future__ import annotations

from pathlib import Path

import pytest

from surgery.errors import ConfigError
from surgery.safe.config_paths import check_config_paths
from tests.test_cli import cli

ESCAPES = [
    ({"model": {"checkpoint": "/etc/passwd.safetensors"}}, "model.checkpoint"),
    ({"model": {"path": "../../other-model"}}, "model.path"),
    ({"input": {"path": "~/data.npz"}}, "input.path"),
    ({"input": {"tokenizer": "/home/me/tok.json"}}, "input.tokenizer"),
    ({"source": {"tokenizer": "a/../../b"}}, "source.tokenizer"),
    ({"actions": {"p": {"from": {"file": "/tmp/x.safetensors", "key": "k"}}}}, "actions.p.from.file"),
    ({"actions": {"p": {"init": {"from": {"file": "../w.safetensors"}}}}}, "actions.p.init.from.file"),
    ({"input": {"path": "http://example.com/data"}}, "input.path"),
    ({"model": {"input": {"path": "/data"}}}, "model.input.path"),
]


@pytest.mark.parametrize(("config", "key"), ESCAPES)
def test_a_path_a_file_sets_outside_the_start_directory_is_refused(config, key) -> None:
    with pytest.raises(ConfigError, match=f"^{key}: .* is refused because safe=true"):
        check_config_paths(config, set())


@pytest.mark.parametrize(("config", "key"), ESCAPES)
def test_the_same_path_typed_on_the_command_line_is_the_users_own(config, key) -> None:
    check_config_paths(config, {key})
    check_config_paths(config, {key.split(".")[0] + "." + key.split(".")[1]} if key.count(".") > 1 else {key})


def test_choosing_a_groups_file_on_the_command_line_does_not_vouch_for_its_paths() -> None:
    with pytest.raises(ConfigError, match=r"^actions.p.from.file: "):
        check_config_paths({"actions": {"p": {"from": {"file": "/x"}}}}, {"actions"})


def test_relative_paths_inside_and_interpolations_pass() -> None:
    check_config_paths({"model": {"checkpoint": "ckpt/model.safetensors", "path": "${..other}"},
                        "input": {"path": "./data"}, "hydra": {"run": {"dir": "/anywhere"}}}, set())  # fmt: skip


def test_the_cli_refuses_an_actions_file_reading_outside_and_runs_the_typed_one(tmp_path: Path) -> None:
    (tmp_path / "conf" / "actions").mkdir(parents=True)
    (tmp_path / "conf" / "actions" / "far.yaml").write_text(
        "p: {kind: modify_output, select: classifier.1, op: patch, from: {file: ../../secret.safetensors, key: k}}\n"
    )
    far = cli("--config-dir", str(tmp_path / "conf"), "+model=cnn", "+actions=far", "safe=true", cwd=tmp_path)
    assert far.returncode == 2
    assert far.stderr.strip().splitlines()[-1].startswith("error: actions.p.from.file: '../../secret.safetensors' is")
    assert not list(tmp_path.glob("outputs/*/*/report.json"))
