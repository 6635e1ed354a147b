"""safe=true: a corpus of escapes (config text that would run code), each refused before anything runs.

Every escape writes a marker file if it ever runs; each test asserts the refusal *and* that the
marker was not created. The allowlist itself is in surgery/core/callables.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.core.callables import check_targets, is_allowed, resolve_callable
from surgery.errors import ConfigError
from tests.test_cli import cli, composed


class _Touch:
    """Unpickling this touches a file: what a malicious checkpoint does."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


def write_files(marker: Path, tmp: Path) -> None:
    """The files the escapes read: a malicious pickle and a local torch.hub repository; each touches ``marker``."""
    (tmp / "evil.pt").write_bytes(pickle.dumps(_Touch(marker)))
    (tmp / "hub").mkdir(exist_ok=True)
    (tmp / "hub" / "hubconf.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\ndef m():\n    return 1\n"
    )


def escapes(marker: Path, tmp: Path) -> dict[str, tuple[str, Any]]:
    """Each escape: (the key of the refusal, relative to actions.a, and the action)."""
    pickled, hub = tmp / "evil.pt", tmp / "hub"
    code = f"import pathlib; pathlib.Path({str(marker)!r}).touch()"
    replace = {"kind": "replace_module", "type": "ReLU"}
    op_fn = {"kind": "modify_output", "select": "fc", "op": "fn"}
    return {
        "pycodecache": ("with._target_", {**replace, "with": {
            "_target_": "torch._inductor.codecache.PyCodeCache.load", "source_code": code}}),
        "torch_load": ("with._target_", {**replace, "with": {
            "_target_": "torch.load", "f": str(pickled), "weights_only": False}}),
        "torch_hub_local": ("with._target_", {**replace, "with": {
            "_target_": "torch.hub.load", "repo_or_dir": str(hub), "model": "m", "source": "local"}}),
        "nested_in_allowed": ("with.activation._target_", {**replace, "with": {
            "_target_": "torch.nn.TransformerEncoderLayer", "d_model": 4, "nhead": 1,
            "activation": {"_target_": "torch.load", "f": str(pickled), "weights_only": False, "_partial_": True}}}),
        "in_args_list": ("with._args_[0]._target_", {**replace, "with": {
            "_target_": "torch.nn.Sequential", "_args_": [{"_target_": "torch.hub.load", "repo_or_dir": str(hub),
                                                          "model": "m", "source": "local"}]}}),
        "fn_partial": ("fn._target_", {**op_fn, "fn": {"_target_": "torch.load", "_partial_": True,
                                                      "weights_only": False}}),
        "fn_import_path": ("fn", {**op_fn, "fn": "torch.serialization:load"}),
        "fn_outside_torch": ("fn._target_", {**op_fn, "fn": {"_target_": "os.system", "_partial_": True}}),
        "fn_via_surgery_models": ("fn", {**op_fn, "fn": "surgery.models.hf:torch.load"}),
        "prefix_lookalike": ("with._target_", {**replace, "with": {"_target_": "torch.nn.modules.module.torch.load",
                                                                  "f": str(pickled), "weights_only": False}}),
        "module_method": ("with._target_", {**replace, "with": {"_target_": "torch.nn.Module.register_forward_hook"}}),
        "init_module": ("fn._target_", {**op_fn, "fn": {"_target_": "torch.nn.init.warnings.warn", "_partial_": True}}),
    }  # fmt: skip


ESCAPES = list(escapes(Path("m"), Path("/nonexistent")))


@pytest.mark.parametrize("name", ESCAPES)
def test_each_escape_is_refused_at_plan_time_and_nothing_runs(name: str, tiny, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    write_files(marker, tmp_path)
    key, action = escapes(marker, tmp_path)[name]
    with pytest.raises(ConfigError) as info:
        surgery.plan(tiny, {"a": action}, safe=True)
    message = str(info.value)
    assert message.startswith(f"actions.a.{key}: "), message
    assert "refused because safe=true" in message and "set safe=false to allow it" in message
    assert "\n" not in message
    assert not marker.exists()


def test_the_three_escapes_did_run_code_without_safe_mode(tiny, tmp_path: Path) -> None:
    """The corpus is real: without safe=true the same configs run the code (so the refusals above matter)."""
    for name in ("pycodecache", "torch_load", "torch_hub_local"):
        marker = tmp_path / f"ran-{name}"
        write_files(marker, tmp_path)
        _, action = escapes(marker, tmp_path)[name]
        with pytest.raises(ConfigError):  # built, then refused for not being a Module: the code already ran
            surgery.plan(tiny, {"a": action})
        assert marker.exists(), name


def test_mode_plan_on_the_command_line_refuses_an_escape(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"import pathlib; pathlib.Path('{marker}').touch()"
    target = "torch._inductor.codecache.PyCodeCache.load"
    escape = f'{{kind:replace_module,type:ReLU,with:{{_target_:{target},source_code:"{code}"}}}}'
    result = cli("+model=cnn", "mode=plan", "safe=true", f"+actions.a={escape}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: actions.a.with._target_: 'torch._inductor.codecache.PyCodeCache.load'")
    assert result.stderr.count("\n") == 1
    assert not marker.exists()  # the same config without safe=true does run it: see test_the_three_escapes_...


def test_hydra_callbacks_are_refused_under_safe_before_hydra_builds_them(tmp_path: Path) -> None:
    marker = tmp_path / "touched"
    callback = f"+hydra.callbacks.x={{_target_:pathlib.Path.touch,self:{{_target_:pathlib.Path,_args_:['{marker}']}}}}"
    result = cli("+model=cnn", "mode=plan", "safe=true", callback, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: hydra.callbacks.x._target_: 'pathlib.Path.touch'"), result.stderr
    assert "refused because safe=true" in result.stderr and result.stderr.count("\n") == 1
    assert not marker.exists()
    # an experiment file that sets safe: true is covered the same way (the composed config decides)
    experiment = tmp_path / "conf" / "experiment"
    experiment.mkdir(parents=True)
    (experiment / "sneaky.yaml").write_text(
        "# @package _global_\nsafe: true\nhydra:\n  callbacks:\n    x:\n      _target_: pathlib.Path.touch\n"
        f"      self: {{_target_: pathlib.Path, _args_: ['{marker}']}}\n"
    )
    result = cli("+model=cnn", "mode=plan", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "+experiment=sneaky",
                 f"hydra.run.dir={tmp_path / 'run2'}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "hydra.callbacks.x._target_: 'pathlib.Path.touch'" in result.stderr
    assert not marker.exists()


# ---------------------------------------------------------------- what is allowed


@pytest.mark.parametrize(
    "target",
    [
        "torch.nn.Linear", "torch.nn.modules.linear.Linear", "torch.nn.GELU", "torch.nn.init.normal_",
        "torch.nn.init.calculate_gain", "torch.nn.functional.gelu", "torch.relu", "torch.clamp",
        "surgery.models.cnn.CNN", "surgery.models.hf.gpt2_tiny",
    ],
)  # fmt: skip
def test_the_allowlist_admits_what_safe_recipes_need(target: str) -> None:
    check_targets({"_target_": target}, "x", safe=True)
    assert is_allowed(target)


def test_allowed_targets_resolve_to_the_same_object_whatever_the_path() -> None:
    assert resolve_callable("torch.nn.modules.activation:GELU", "fn", safe=True) is nn.GELU
    assert resolve_callable("torch.nn.functional:gelu", "fn", safe=True) is torch.nn.functional.gelu
    assert not is_allowed("torch.nn.modules.linear.math")  # a module, not a callable


def test_every_shipped_model_and_callable_passes_safe_mode() -> None:
    for name in ("cnn", "mlp", "functions", "gpt2_tiny", "bert_tiny"):
        check_targets(dict(composed(f"+model={name}").model), "model", safe=True)


def test_safe_mode_still_runs_an_allowed_replacement(tiny) -> None:
    x = torch.randn(2, 1, 4, 4)
    gelu = {"kind": "replace_module", "type": "ReLU", "with": {"_target_": "torch.nn.GELU"}}
    with surgery.apply(tiny, {"a": gelu}, safe=True):
        out = tiny(x)
    expected = tiny.fc(tiny.pool(nn.functional.gelu(tiny.norm(tiny.conv(x)))).flatten(1))
    assert torch.equal(out, expected)
