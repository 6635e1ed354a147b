"""The command line, end to end: a few real subprocesses, the rest composed in-process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from surgery.app.job import run_job
from surgery.core.paths import config_dir, group_options
from surgery.errors import SurgeryError
from tests.exact_runs import job_of, linearized, logits, max_abs

REPO = Path(__file__).resolve().parents[1]


class Pickled:
    """An arbitrary object: loading it would need full unpickling, which surgery never does."""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -m surgery ARGS`` in ``cwd`` with this checkout importable."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # packages beside, kept
    env = {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "surgery", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def only_run_dir(root: Path) -> Path:
    reports = list(root.glob("outputs/*/*/report.json"))
    assert len(reports) == 1, reports
    return reports[0].parent


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# ---------------------------------------------------------------- subprocess: the real entry point


def test_main_job_writes_a_report_and_exits_0(tmp_path: Path) -> None:
    result = cli("+model=cnn", "+actions=[linearize,capture_block3]", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"linearize\s+replace_forward\s+forward hook\s+3\s+block1.act", result.stdout)
    assert "restored exactly" in result.stdout
    run = only_run_dir(tmp_path)
    report = json.loads((run / "report.json").read_text())
    assert report["plan"][0]["matched"] == ["block1.act", "block2.act", "block3.act"]
    assert report["plan"][0]["hooks"] == 3
    # linearize and capture change no tensor (no report["restored"] check: see test_a_run_that_does_not_restore_fails)
    assert report["fingerprints"]["state_dict_before"] == report["fingerprints"]["state_dict_after"]
    model, x = job_of("+model=cnn")
    original = logits(model, x)
    assert report["difference"]["comparable"]
    assert report["difference"]["max_abs"] == max_abs(logits(linearized(model), x), original)
    assert set(report["fingerprints"]) == {
        "config", "matched_modules", "input", "state_dict_before", "state_dict_after", "output"
    }  # fmt: skip
    from safetensors.torch import load_file

    captures = load_file(str(run / "captures.safetensors"))  # one call per batch: 359 digits in batches of 64
    assert set(captures) == {f"capture_block3/block3/{what}/{i}" for what in ("input.0", "output") for i in range(6)}
    assert captures["capture_block3/block3/output/0"].shape == (64, 32, 3, 3)
    assert captures["capture_block3/block3/output/5"].shape == (359 - 5 * 64, 32, 3, 3)
    # accuracy before and after, as a user would compute it by hand on the same batches
    from surgery.data.sources import digits

    images, labels = digits("test", (1, 28, 28)).tensors
    fresh, _ = job_of("+model=cnn")  # linearized() above changed `model` in place
    before = torch.cat([logits(fresh, (images[i : i + 64],)) for i in range(0, 359, 64)])
    after = torch.cat([logits(linearized(fresh), (images[i : i + 64],)) for i in range(0, 359, 64)])
    metrics = report["metrics"]
    assert metrics["unmodified"]["accuracy"] == float((before.argmax(-1) == labels).double().mean()) >= 0.95
    assert metrics["surgered"]["accuracy"] == float((after.argmax(-1) == labels).double().mean())
    assert re.search(r"accuracy 9\d\.\d\d% → \d+\.\d\d%", result.stdout)
    assert (run / ".hydra" / "config.yaml").exists()


def test_typo_in_an_action_key_exits_2_naming_the_key_and_writes_nothing(tmp_path: Path) -> None:
    result = cli("+model=cnn", "+actions=linearize", "+actions.linearize.selct=block1", cwd=tmp_path)
    assert result.returncode == 2
    assert "actions.linearize.selct: unknown key. Did you mean 'select'?" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("outputs/*/*/report.json"))


def test_unknown_model_option_exits_2(tmp_path: Path) -> None:
    result = cli("+model=resnet", cwd=tmp_path)
    assert result.returncode == 2
    assert "resnet" in result.stderr and "Traceback" not in result.stderr


def test_no_model_prints_the_options(tmp_path: Path) -> None:
    result = cli(cwd=tmp_path)
    assert result.returncode == 0
    assert "model:" in result.stdout and "cnn" in result.stdout and "linearize" in result.stdout
    assert not list(tmp_path.iterdir())  # nothing written


def test_modes_plan_and_modules(tmp_path: Path) -> None:
    result = cli("+model=functions", "+actions=function_linear", "mode=plan", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "add_b   add_parameter    apply pass    4  ab.a.b, ab.b.b, cd.c.b, cd.d.b" in result.stdout
    report = json.loads((only_run_dir(tmp_path) / "report.json").read_text())
    assert report["mode"] == "plan" and "output" not in report
    (tmp_path / "m").mkdir()
    result = cli("+model=functions", "mode=modules", cwd=tmp_path / "m")
    assert re.search(r"ab\.a\s+Function_A\s+1\s+W\[1\]", result.stdout)


# ---------------------------------------------------------------- in-process: every config, every mode


def test_functions_run_gives_the_hand_computed_numbers(tmp_path: Path) -> None:
    cfg = composed("+model=functions", "+actions=function_linear", "backward=true")
    report = run_job(cfg, tmp_path)
    # every Function becomes x * 1 + 1, so the model computes x1 + x2 + 4
    gen_inputs = report["input"]
    assert report["output"]["mean"] == pytest.approx(gen_inputs[0]["mean"] + gen_inputs[1]["mean"] + 4)
    assert report["model"]["parameters_after"] == report["model"]["parameters_before"] + 4


# hf needs a directory (test_lm); llama_meta has no weights, it only plans (test_meta)
@pytest.mark.parametrize("model", [m for m in group_options("model") if m not in ("hf", "llama_meta")])
def test_every_model_config_builds_and_runs(model: str, tmp_path: Path) -> None:
    report = run_job(composed(f"+model={model}", "+actions=init_ones", "backward=true"), tmp_path)
    assert report["fingerprints"]["state_dict_before"] != report["fingerprints"]["state_dict_after"]


def test_a_run_that_does_not_restore_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why no test asserts report["restored"]: a run whose remove() leaves a change raises instead of reporting."""
    import surgery.core.engine

    monkeypatch.setattr(surgery.core.engine.Surgery, "remove", lambda self, verify=False: None)
    with pytest.raises(RuntimeError, match="the model was not restored exactly after remove"):
        run_job(composed("+model=mlp", "+actions=init_ones"), tmp_path)
    assert not (tmp_path / "report.json").exists()


ACTIONS_FOR = {
    "function_linear": "functions",
    "add_five": "functions",
    "ablate_mlp": "gpt2_tiny",
    "capture_residual": "gpt2_tiny",
    "logit_lens": "gpt2_tiny",
    "lora": "gpt2_tiny",
    "scale_attention": "bert_tiny",
    "patch_block3": None,  # needs a captures file: tested in test_activation_patching_across_two_runs
    "patch_resid": None,  # needs a language model directory and a source prompt: tests/test_lm_cli.py
    "on_load": None,  # needs earlier actions and a checkpoint: tested in test_saved_surgered_model_reloads_...
}


@pytest.mark.parametrize("actions", group_options("actions"))
def test_every_actions_config_runs_on_a_model_it_is_meant_for(actions: str, tmp_path: Path) -> None:
    model = ACTIONS_FOR.get(actions, "cnn")
    if model is None:
        pytest.skip("covered by its own test")
    report = run_job(composed(f"+model={model}", f"+actions={actions}", "backward=true"), tmp_path)
    assert report["plan"] and all(step["matched"] for step in report["plan"])
    assert all(step["hooks"] or step["mechanism"] == "apply pass" for step in report["plan"])


def test_same_config_and_seed_give_identical_fingerprints(tmp_path: Path) -> None:
    cfg = composed("+model=cnn", "+input=random", "+actions=[linearize,init_ones]", "seed=5")
    first = run_job(cfg, tmp_path / "a")["fingerprints"]
    assert run_job(cfg, tmp_path / "b")["fingerprints"] == first
    assert (
        run_job(composed("+model=cnn", "+input=random", "+actions=[linearize,init_ones]", "seed=6"), tmp_path / "c")[
            "fingerprints"
        ]["input"]
        != first["input"]
    )


def test_input_file_and_bad_inputs(tmp_path: Path) -> None:
    torch.save(torch.randn(1, 28, 28), tmp_path / "digit.pt")
    report = run_job(
        composed("+model=cnn", "+actions=linearize", "+input=file", f"input.path={tmp_path / 'digit.pt'}"), tmp_path
    )
    assert report["input"][0]["shape"] == [1, 1, 28, 28]
    torch.save(torch.randn(3, 5), tmp_path / "wrong.pt")
    with pytest.raises(SurgeryError, match=r"input\.path: .*wrong\.pt' holds a tensor of shape \[3, 5\]"):
        run_job(
            composed("+model=cnn", "+actions=linearize", "+input=file", f"input.path={tmp_path / 'wrong.pt'}"), tmp_path
        )
    with pytest.raises(SurgeryError, match=r"device: 'cuda' asked for, but torch sees no CUDA GPU"):
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        run_job(composed("+model=cnn", "+actions=linearize", "device=cuda"), tmp_path)
    with pytest.raises(SurgeryError, match=r"^seed: Value 'abc'"):
        run_job(composed("+model=cnn", "seed=abc"), tmp_path)
    assert not (tmp_path / "report.json").exists() or report


def test_checkpoint_round_trip_and_pickled_object_refused(tmp_path: Path) -> None:
    cfg = composed("+model=cnn", "+actions=init_ones", "save_model=true")
    run_job(cfg, tmp_path)
    saved = tmp_path / "model.safetensors"
    assert saved.exists()
    report = run_job(composed("+model=cnn", "+actions=linearize", f"model.checkpoint={saved}"), tmp_path / "b")
    assert report["model"]["parameters_before"] > 0
    torch.save({"weights": Pickled()}, tmp_path / "evil.pt")
    with pytest.raises(SurgeryError, match=r"model\.checkpoint: cannot read .*evil\.pt.*weights_only=True"):
        run_job(
            composed("+model=cnn", "+actions=linearize", f"model.checkpoint={tmp_path / 'evil.pt'}"), tmp_path / "c"
        )


def test_activation_patching_across_two_runs(tmp_path: Path) -> None:
    first = run_job(composed("+model=cnn", "+input=random", "+actions=capture_block3"), tmp_path / "a")
    captures = tmp_path / "a" / "captures.safetensors"
    patched = run_job(
        composed(
            "+model=cnn",
            "+input=random",
            "+actions=patch_block3",
            f"actions.patch_block3.from.file={captures}",
            "input.seed=7",
        ),
        tmp_path / "b",
    )
    assert patched["fingerprints"]["input"] != first["fingerprints"]["input"]  # another input ...
    assert patched["fingerprints"]["output"] == first["fingerprints"]["output"]  # ... yet block3 and so logits are A's
    # ... and they differ from what B gives unpatched by exactly this much
    model, x_a = job_of("+model=cnn", "+input=random")
    _, x_b = job_of("+model=cnn", "+input=random", "input.seed=7")
    assert patched["difference"]["max_abs"] == max_abs(logits(model, x_a), logits(model, x_b))


def test_sequence_logits_take_class_losses_and_shared_captures_are_written(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cfg = composed(
        "+model=gpt2_tiny", "+actions=capture_residual", "+actions.capture_residual.what=[input,output]",
        "backward=true", "loss=cross_entropy",
    )  # fmt: skip
    report = run_job(cfg, tmp_path)
    assert report["plan"][0]["hooks"] == 2
    from safetensors.torch import load_file

    captures = load_file(str(tmp_path / "captures.safetensors"))
    # block 0's output is block 1's input: the same tensor, written twice
    assert torch.equal(
        captures["capture_residual/transformer.h.0/output"], captures["capture_residual/transformer.h.1/input.0"]
    )


def test_saved_surgered_model_reloads_strictly_from_the_cli(tmp_path: Path) -> None:
    first = run_job(composed("+model=functions", "+actions=function_linear", "save_model=true"), tmp_path / "a")
    saved = tmp_path / "a" / "model.safetensors"
    from safetensors.torch import load_file

    assert sorted(k for k in load_file(str(saved)) if k.endswith(".b")) == ["ab.a.b", "ab.b.b", "cd.c.b", "cd.d.b"]
    again = run_job(
        composed("+model=functions", "+actions=[function_linear,on_load]", f"model.checkpoint={saved}", "model.w_a=5"),
        tmp_path / "b",
    )
    assert again["fingerprints"]["output"] == first["fingerprints"]["output"]
    with pytest.raises(SurgeryError, match=r"model\.checkpoint: .* does not fit the model \(unexpected keys: ab\.a\.b"):
        run_job(composed("+model=functions", "+actions=function_linear", f"model.checkpoint={saved}"), tmp_path / "c")


@pytest.mark.parametrize("actions", group_options("actions"))
def test_shipped_recipes_run_no_code_they_name(actions: str) -> None:
    """Every shipped recipe passes safe=true: no import path, no _target_ outside torch/surgery."""
    from surgery.core.callables import check_targets
    from surgery.core.compiler import load_actions

    def import_paths(node: object) -> list[str]:
        if isinstance(node, dict):
            return [p for value in node.values() for p in import_paths(value)]
        return [node] if isinstance(node, str) and re.fullmatch(r"[\w.]+:[\w.]+", node) else []  # pkg.mod:fn

    for name, node in load_actions(actions).items():
        check_targets(node, f"actions.{name}", safe=True)
        assert import_paths(node) == []


def test_an_internal_failure_exits_1_with_a_traceback(tmp_path: Path) -> None:
    result = cli(
        "+model=mlp", "model._target_=tests.helpers_callables.BrokenZeroGrad", "~model.in_features", "~model.hidden",
        "~model.depth", "~model.out_features", "~model.activation", "model.input.shape=[1,2]", "+actions=init_ones",
        f"hydra.run.dir={tmp_path / 'run'}", cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ZeroDivisionError: a bug that is not the user's" in result.stderr
    assert not (tmp_path / "run" / "report.json").exists()
