"""Reproducibility: the same config and seed give bit-identical fingerprints, and replay checks it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from surgery.app import replay
from surgery.app.job import run_job
from surgery.core.paths import config_dir

REPO = Path(__file__).resolve().parents[1]
FINGERPRINTS = ("config", "matched_modules", "input", "state_dict_before", "state_dict_after", "output")


@pytest.fixture(autouse=True)
def private_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Replay's temporary run directories go under the test's own tmp_path (one is kept when different)."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp"


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def saved_run(cfg: DictConfig, run_dir: Path) -> Path:
    """A run directory as the CLI leaves it: report.json from run_job and the config Hydra saves."""
    run_job(cfg, run_dir)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    return run_dir


def results(stdout: str) -> dict[str, str]:
    """{fingerprint: identical|different} from replay's table."""
    return dict(re.findall(r"^(\w+)\s+(identical|different)\b", stdout, flags=re.M))


def test_same_config_and_seed_give_bit_identical_fingerprints_and_captures(tmp_path: Path) -> None:
    cfg = composed("+model=cnn", "+actions=[linearize,capture_block3]")
    reports = [run_job(cfg, tmp_path / str(i)) for i in range(3)]
    assert set(reports[0]["fingerprints"]) == set(FINGERPRINTS)
    assert all(r["fingerprints"] == reports[0]["fingerprints"] for r in reports[1:])
    captures = {(tmp_path / str(i) / "captures.safetensors").read_bytes() for i in range(3)}
    assert len(captures) == 1


def test_cli_run_replays_identically_from_the_same_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save(torch.randn(4, 16, generator=torch.Generator().manual_seed(3)), tmp_path / "x.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}
    args = ["+model=mlp", "+actions=[linearize,scale_output]", "actions.scale_output.value=3"]
    args += ["+input=file", "input.path=x.pt", "hydra.run.dir=run"]  # a relative path, read from cwd
    run = subprocess.run(
        [sys.executable, "-m", "surgery", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    result = subprocess.run(
        [sys.executable, "-m", "surgery.replay", "run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert results(result.stdout) == dict.fromkeys(FINGERPRINTS, "identical")
    assert "all 6 fingerprints identical" in result.stdout
    assert "scale_output" not in result.stdout  # the job's own prints went to stderr

    # tamper with one fingerprint: replay names it and exits 1
    monkeypatch.chdir(tmp_path)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    report["fingerprints"]["output"] = "0" * 64
    (tmp_path / "run" / "report.json").write_text(json.dumps(report))
    assert replay.main(["run", "--out", "again"]) == 1
    # started elsewhere, the relative input path is not found: bad input
    monkeypatch.chdir(tmp_path / "run")
    assert replay.main([str(tmp_path / "run")]) == 2
    assert "input.path: file 'x.pt' does not exist (relative paths are read from the current" in capsys.readouterr().err


def test_tampered_report_shows_different_for_that_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = saved_run(composed("+model=functions", "+actions=add_five", "seed=4"), tmp_path / "run")
    assert replay.main([str(run_dir)]) == 0
    report = json.loads((run_dir / "report.json").read_text())
    report["fingerprints"]["state_dict_after"] = "f" * 64
    (run_dir / "report.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert replay.main([str(run_dir), "--out", str(tmp_path / "new")]) == 1
    out = capsys.readouterr().out
    assert results(out) == {**dict.fromkeys(FINGERPRINTS, "identical"), "state_dict_after": "different"}
    assert "state_dict_after   different  (was ffffffffffff, now " in out
    assert f"1 of 6 fingerprints different: state_dict_after; new run in {tmp_path / 'new'}" in out
    assert (tmp_path / "new" / "report.json").is_file()


def test_a_plan_run_compares_the_fingerprints_it_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = saved_run(composed("+model=functions", "+actions=function_linear", "mode=plan"), tmp_path / "run")
    assert replay.main([str(run_dir)]) == 0
    assert results(capsys.readouterr().out) == {"config": "identical", "matched_modules": "identical"}
    assert not list((tmp_path / "tmp").iterdir())  # an identical replay removes its temporary run


def test_a_changed_config_changes_the_fingerprints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = saved_run(composed("+model=functions", "+actions=add_five"), tmp_path / "run")
    OmegaConf.save(composed("+model=functions", "+actions=add_five", "seed=1"), run_dir / ".hydra" / "config.yaml")
    assert replay.main([str(run_dir)]) == 1
    out = capsys.readouterr().out
    kept = next((tmp_path / "tmp").iterdir())  # a differing replay keeps its new run for a look
    assert f"new run in {kept}" in out and (kept / "report.json").is_file()
    found = results(out)
    assert found["config"] == found["input"] == found["output"] == "different"
    assert found["matched_modules"] == "identical"


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        ("none", ["missing"], "missing: no such directory"),
        ("empty", ["run"], "run: no .hydra/config.yaml; is this a run directory"),
        ("no_report", ["run"], "run: no report.json"),
        ("no_model", ["run"], "config.yaml: not a surgery job config (no model)"),
        ("no_prints", ["run"], "report.json: holds no fingerprints to compare"),
        ("bad_value", ["run"], "seed: Value 'abc'"),
        ("empty", ["run", "--out", "run"], "--out must not be RUN_DIR itself"),
    ],
)
def test_bad_input_exits_2_with_one_message(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    setup: str,
    args: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    if setup != "none":
        (run_dir / ".hydra").mkdir(parents=True)
    config = {"model": {"_target_": "surgery.models.functions.Functions"}, "seed": "abc" if setup == "bad_value" else 0}
    if setup in ("no_report", "no_model", "no_prints", "bad_value"):
        OmegaConf.save(
            OmegaConf.create({"seed": 0} if setup == "no_model" else config), run_dir / ".hydra" / "config.yaml"
        )
    if setup in ("no_model", "no_prints", "bad_value"):
        prints = {} if setup == "no_prints" else {"config": "0" * 64}
        (run_dir / "report.json").write_text(json.dumps({"fingerprints": prints}))
    assert replay.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list((tmp_path / "tmp").iterdir())  # the temporary run directory is gone again


def test_report_environment_names_the_cpu_and_its_capability(tmp_path: Path) -> None:
    report = run_job(composed("+model=functions", "+actions=add_five"), tmp_path)
    env = report["environment"]
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        if names:  # some CPUs (ARM) name no "model name" in /proc/cpuinfo
            assert env["cpu"] == names[0]
    assert env["torch"] == torch.__version__


def test_the_run_saves_batch_zero_output_for_replay(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from surgery.app.report import fingerprint

    report = run_job(composed("+model=mlp", "+actions=scale_output"), tmp_path)
    assert report["output_file"] == "output.safetensors"
    saved = load_file(str(tmp_path / "output.safetensors"))
    assert list(saved) == ["output"]
    assert fingerprint(saved["output"]) == report["fingerprints"]["output"]  # the very tensor fingerprinted


def shifted(path: Path, shift: float) -> tuple[str, float]:
    """Shift the first float tensor's first element (as another machine might); its key and the max abs difference."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    key = next(k for k, v in tensors.items() if v.is_floating_point())
    before = tensors[key].clone()
    tensors[key].view(-1)[0] += shift
    save_file(tensors, str(path))
    gap = (tensors[key].double() - before.double()).abs().max().item()
    assert gap > 0, "the shift was lost to rounding"
    return key, gap


def test_replay_says_by_how_much_output_weights_and_captures_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = composed("+model=mlp", "+actions=[scale_output,capture]", "save_model=true")
    run_dir = saved_run(cfg, tmp_path / "run")
    out_key, out_gap = shifted(run_dir / "output.safetensors", 3e-8)  # the size of the AMD/Intel GEMM difference
    weight_key, weight_gap = shifted(run_dir / "model.safetensors", 0.5)
    capture_key, capture_gap = shifted(run_dir / "captures.safetensors", 0.25)
    report = json.loads((run_dir / "report.json").read_text())
    report["fingerprints"]["output"] = report["fingerprints"]["state_dict_after"] = "e" * 64
    (run_dir / "report.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert replay.main([str(run_dir), "--out", str(tmp_path / "new")]) == 1
    out = capsys.readouterr().out
    assert f"; max |difference| {out_gap:.3g} in {out_key})" in out
    assert re.search(r"^output +different +\(was e{12}, now \w{12}; max \|difference\| ", out, flags=re.M), out
    assert "state_dict_after   different  (was eeeeeeeeeeee, now " in out
    assert f"; max |difference| {weight_gap:.3g} in {weight_key})" in out
    assert f"captures.safetensors: max |difference| {capture_gap:.3g} in {capture_key}" in out
    assert "another environment" not in out  # same machine


def test_replay_without_saved_tensors_says_it_cannot_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = saved_run(composed("+model=functions", "+actions=add_five"), tmp_path / "run")
    report = json.loads((run_dir / "report.json").read_text())
    report["fingerprints"]["state_dict_after"] = "f" * 64
    (run_dir / "report.json").write_text(json.dumps(report))
    (run_dir / "output.safetensors").unlink()
    capsys.readouterr()
    assert replay.main([str(run_dir), "--out", str(tmp_path / "new")]) == 1
    out = capsys.readouterr().out
    assert f"; no model.safetensors in {run_dir} to measure by)" in out  # save_model=true saves one


def other_than(value: object, *candidates: str) -> str:
    """The first candidate that is not ``value``: a fake that differs from this machine's, whatever it is."""
    return next(c for c in candidates if c != value)


@pytest.mark.parametrize("machine", ["this machine", "an AVX-512 EPYC", "an AVX2 Xeon"])
def test_replay_names_what_differs_in_the_environment(
    machine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever CPU runs the suite (issue 25: it failed on an AMD EPYC reporting AVX512), here and as if on others."""
    if machine != "this machine":
        its_cpu, its_capability = {
            "an AVX-512 EPYC": ("AMD EPYC 9654 96-Core Processor", "AVX512"),
            "an AVX2 Xeon": ("Intel(R) Xeon(R) Platinum 8480+", "AVX2"),
        }[machine]
        monkeypatch.setattr("surgery.app.report.cpu_model", lambda: its_cpu)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: its_capability)
    run_dir = saved_run(composed("+model=functions", "+actions=add_five"), tmp_path / "run")
    report = json.loads((run_dir / "report.json").read_text())
    now = dict(report["environment"])
    # values that differ from whatever this machine reports (no test may assume the CPU it runs on)
    cpu = other_than(now["cpu"], "Intel(R) Xeon(R) Platinum 8480+", "AMD EPYC 9654 96-Core Processor")
    capability = other_than(now["cpu_capability"], "AVX512", "AVX2")
    version = other_than(now["torch"], "2.12.0", "2.11.0")
    report["environment"].update(cpu=cpu, cpu_capability=capability, torch=version)
    (run_dir / "report.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert replay.main([str(run_dir)]) == 0  # every fingerprint still identical
    out = capsys.readouterr().out
    assert (
        f"another environment than the original run's: cpu: {cpu!r} -> {now['cpu']!r};"
        f" cpu_capability: {capability!r} -> {now['cpu_capability']!r}; torch: {version!r} -> {now['torch']!r}\n"
    ) in out
    del report["environment"]["cpu"]  # a report from before the CPU was recorded
    (run_dir / "report.json").write_text(json.dumps(report))
    assert replay.main([str(run_dir)]) == 0
    assert f"cpu: not recorded by the original run, now {now['cpu']!r}" in capsys.readouterr().out


# ---------------------------------------------------------------- a run directory from someone else


def tampered(run_dir: Path, marker: Path, **changes: object) -> None:
    """Rewrite the saved config as someone might: ``safe: false`` and a model that touches ``marker`` when built."""
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    cfg.safe = False
    cfg.model = {"_target_": "pathlib.Path.touch", "self": {"_target_": "pathlib.Path", "_args_": [str(marker)]}}
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")


def test_replay_runs_a_tampered_saved_config_under_safe_mode_unless_trusted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = saved_run(composed("+model=functions", "+actions=add_five"), tmp_path / "run")
    marker = tmp_path / "ran"
    tampered(run_dir, marker)
    capsys.readouterr()
    assert replay.main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model._target_: 'pathlib.Path.touch' is not on the safe-mode allowlist")
    assert "--trust runs it as saved" in err and err.count("\n") == 1
    assert not marker.exists()
    assert replay.main([str(run_dir), "--trust"]) == 2  # trusted, it is built (and then is no nn.Module)
    assert marker.exists()


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"secret": "${oc.env:HOME}"}, "secret: ${oc.env:...} runs a resolver, refused because safe=true"),
        ({"seed": "${oc.decode:'4'}"}, "seed: ${oc.decode:...} runs a resolver"),
        ({"a": "${b}", "b": "${a}"}, "an interpolation loop"),
    ],
)
def test_replay_checks_the_saved_configs_interpolations_before_resolving_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict, said: str
) -> None:
    run_dir = saved_run(composed("+model=functions", "+actions=add_five"), tmp_path / "run")
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    cfg.merge_with(changes)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    capsys.readouterr()
    assert replay.main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and "Traceback" not in err


def test_replay_under_forced_safe_mode_keeps_the_saved_configs_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A saved config with safe: false replays identically: forcing safe mode is not a change of config."""
    cfg = composed("+model=functions", "+actions=add_five", "safe=false")
    run_dir = saved_run(cfg, tmp_path / "run")
    assert replay.main([str(run_dir)]) == 0
    assert results(capsys.readouterr().out)["config"] == "identical"
