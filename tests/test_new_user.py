"""What a new user trips over (issue 14): the real command line where it matters, the rest in-process."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from omegaconf import OmegaConf

from surgery.core.paths import config_dir
from surgery.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
TINY = """import torch


class TinyNet(torch.nn.Sequential):
    def __init__(self):
        super().__init__(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
"""


def run(*args: str, cwd: Path, script: Path | None = None, pipe_lines: int = 0) -> subprocess.CompletedProcess[str]:
    """``python -m surgery ARGS`` in ``cwd`` (or a console-script-like ``script`` outside ``cwd``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}
    command = [sys.executable, *([str(script)] if script else ["-m", "surgery"]), *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def user_configs(root: Path) -> Path:
    """A user's own model (a module next to where they run), model config and actions file."""
    (root / "mynet.py").write_text(TINY)
    (root / "cfg" / "model").mkdir(parents=True)
    (root / "cfg" / "actions").mkdir()
    (root / "cfg" / "model" / "tiny.yaml").write_text("_target_: mynet.TinyNet\ninput:\n  shape: [4, 4]\n")
    (root / "cfg" / "actions" / "look.yaml").write_text(
        "cap: {kind: capture, select: '0'}\nlg: {kind: log, select: '2'}\n"
    )
    return root / "cfg"


# ---------------------------------------------------------------- the real command line


def test_missing_model_is_one_line_and_the_overview_lists_the_users_configs(tmp_path: Path) -> None:
    cfg = user_configs(tmp_path)
    missing = run("+actions=linearize", f"--config-dir={cfg}", cwd=tmp_path)
    assert missing.returncode == 2, missing.stderr
    assert re.fullmatch(r"error: model: no model chosen; add \+model=NAME \(models: [^\n]*\btiny\)\n", missing.stderr)
    overview = run(f"--config-dir={cfg}", cwd=tmp_path)
    assert overview.returncode == 0 and re.search(r"^model: .*\btiny\b", overview.stdout, re.M), overview.stdout
    assert re.search(r"^actions: .*\blook\b", overview.stdout, re.M)
    searched = run(f"hydra.searchpath=[file://{cfg}]", cwd=tmp_path)
    assert searched.returncode == 0 and re.search(r"^model: .*\btiny\b", searched.stdout, re.M), searched.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg", "mynet.py"]  # no run directory left behind


def test_users_module_backward_logging_file_modes_and_report_md(tmp_path: Path) -> None:
    """Through a console-script-like entry point (its own directory first on sys.path, not cwd)."""
    cfg = user_configs(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "surgery"
    script.write_text("import sys\nfrom surgery.app.cli import main\nsys.exit(main())\n")
    result = run("+model=tiny", "+actions=look", "backward=true", f"--config-dir={cfg}", cwd=tmp_path, script=script)
    assert result.returncode == 0, result.stderr
    out = next(tmp_path.glob("outputs/*/*"))
    report = json.loads((out / "report.json").read_text())

    # the same in plain PyTorch: seed, build, the run's input, the loss backward starts from
    sys.path.insert(0, str(tmp_path))
    try:
        from mynet import TinyNet  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    from surgery.app.inputs import make_inputs

    torch.manual_seed(0)
    model = TinyNet().eval()
    x = make_inputs({"shape": [4, 4]}, 0, torch.float32, torch.device("cpu"))[0]
    loss = float(model(x.detach().requires_grad_(True)).sum().detach())
    assert report["backward"] == {"loss": "sum", "value": loss, "original": loss, "mean": loss}
    md = (out / "report.md").read_text()
    assert "## Backward pass" in md and f"surgered, batch 0: {loss:.6g}" in md
    capture_rows = [line for line in md.splitlines() if line.startswith("| `cap/")]
    assert capture_rows and all("…" not in row and "mean " in row for row in capture_rows), capture_rows

    log = (out / "surgery.log").read_text()
    for line in ("cap  ", "[lg] 2 (Linear)", "restored exactly"):  # the plan, the log action, the summary
        assert line in result.stdout and line in log, line
    mode = 0o666 & ~_umask()
    assert stat.S_IMODE((out / ".hydra" / "config.yaml").stat().st_mode) == mode  # Hydra's own
    for path in (out / "report.json", out / "report.md", out / "captures.safetensors", out / "output.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path


def test_plan_names_every_match_and_modules_say_where(tmp_path: Path) -> None:
    (tmp_path / "cfg" / "actions").mkdir(parents=True)
    (tmp_path / "cfg" / "actions" / "all.yaml").write_text("everything: {kind: capture, select: '**'}\n")
    result = run(
        "-m",
        "+model=mlp",
        "+actions=all",
        "mode=plan,modules",
        "verbose=true",
        f"--config-dir={tmp_path / 'cfg'}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    plan_dir, modules_dir = sorted(p for p in tmp_path.glob("multirun/*/*/*") if p.is_dir())
    names = json.loads((plan_dir / "report.json").read_text())["plan"][0]["matched"]
    assert len(names) > 4 and "more)" in result.stdout  # the table cuts them short ...
    assert all(f"\n  {name}\n" in result.stdout + "\n" for name in names)  # ... verbose lists every one
    assert f"every matched name: {plan_dir / 'report.json'}" in result.stdout
    assert f"wrote {modules_dir}" in result.stdout
    assert "own tensors" in (modules_dir / "surgery.log").read_text()  # the module table


def test_pasted_suggestions_work_and_typos_get_ours(tmp_path: Path) -> None:
    ok = run("+model=mlp", "+actions=linearize", "input.shape=[3,16]", "actions.linearize.allow_empty=true",
             "compare=false", cwd=tmp_path)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(next(tmp_path.glob("outputs/*/*/report.json")).read_text())["input"][0]["shape"] == [3, 16]
    typo = run("+model=cnn", "+actions=linearize", "actions.linearize.selct=block1", cwd=tmp_path / "outputs")
    assert typo.returncode == 2
    assert typo.stderr.startswith("error: actions.linearize.selct: unknown key. Did you mean 'select'?")
    assert len(typo.stderr.strip().splitlines()) == 1


def test_help_says_plus_and_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "surgery", "--help"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    head = [process.stdout.readline() for _ in range(4)]
    process.stdout.close()  # as `| head -4` does
    stderr = process.stderr.read()
    assert process.wait(timeout=60) == 0 and "Traceback" not in stderr, stderr
    assert "+group=option" in "".join(head) and "(group=option)" not in "".join(head)


def test_actions_list_file_and_missing_launcher_get_our_words(tmp_path: Path) -> None:
    (tmp_path / "cfg" / "actions").mkdir(parents=True)
    (tmp_path / "cfg" / "actions" / "lst.yaml").write_text("- kind: capture\n  select: '*'\n")
    result = run("+model=mlp", "+actions=lst", f"--config-dir={tmp_path / 'cfg'}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "error: actions/lst: an actions file is a mapping of named actions (NAME: {kind: ..., select: ...}),"
        " not a YAML list\n"
    )
    hidden = (
        "import sys; sys.modules['hydra_plugins.hydra_joblib_launcher'] = None;"
        " sys.argv = ['surgery', '+model=mlp', 'hydra/launcher=joblib', 'mode=plan'];"
        " from surgery.app.cli import main; main()"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    plain = subprocess.run([sys.executable, "-c", hidden], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert plain.returncode == 2
    assert plain.stderr == "error: hydra/launcher=joblib: not installed; pip install 'surgery[sweep]'\n"


def test_safe_mode_refuses_logging_that_runs_code_before_hydra_configures_it(tmp_path: Path) -> None:
    (tmp_path / "evil.py").write_text(
        "import logging, pathlib\n\n\ndef make(*a, **k):\n    pathlib.Path('MARKER').write_text('ran')\n"
        "    return logging.StreamHandler()\n"
    )
    (tmp_path / "cfg" / "experiment").mkdir(parents=True)
    (tmp_path / "cfg" / "experiment" / "ev.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /model: mlp\nsafe: true\nmode: modules\nhydra:\n  hydra_logging:\n"
        "    version: 1\n    handlers:\n      x:\n        (): evil.make\n    root:\n      handlers: [x]\n"
    )
    result = run("+experiment=ev", f"--config-dir={tmp_path / 'cfg'}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: hydra.hydra_logging.handlers.x.(): a logging factory")
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "MARKER").exists() and not (tmp_path / "outputs").exists()


# ---------------------------------------------------------------- in-process


@pytest.mark.parametrize(
    ("node", "refused"),
    [
        ({"handlers": {"h": {"class": "evil.Handler"}}}, "hydra.job_logging.handlers.h.class"),
        ({"formatters": {"f": {"()": "colorlog.ColoredFormatter"}}}, "hydra.job_logging.formatters.f.()"),
        ({"handlers": {"h": {"class": "logging.StreamHandler", "stream": "ext://evil.stream"}}}, "stream"),
        ({"handlers": {"h": {"class": "logging.StreamHandler", ".": {"x": 1}}}}, "hydra.job_logging.handlers.h.."),
        ({"handlers": {"h": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout"}}}, None),
    ],
)
def test_safe_logging_allowlist(node: dict, refused: str | None) -> None:
    from surgery.app import hydra_hooks

    config = OmegaConf.create({"safe": True, "hydra": {"hydra_logging": None, "job_logging": node}})
    if refused is None:
        hydra_hooks.check_logging(config)
        return
    with pytest.raises(ConfigError, match=re.escape(refused)):
        hydra_hooks.check_logging(config)


def test_every_override_a_message_suggests_composes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ``KEY=`` our messages suggest, pasted onto the config it is meant for, is accepted by Hydra."""
    from surgery.app import hydra_hooks

    suggested = set()
    for path in (REPO / "surgery").rglob("*.py"):
        for line in path.read_text().splitlines():
            if '"' in line or "'" in line:
                suggested |= set(re.findall(r"(?<![\w.{+])((?:input|model|source)(?:\.[a-z_]+)+)=", line))
    assert {"input.shape", "input.vocab", "input.target", "model.path"} <= suggested
    patched = hydra_hooks._patch_overrides(ConfigLoaderImpl._apply_overrides_to_config)
    monkeypatch.setattr(ConfigLoaderImpl, "_apply_overrides_to_config", patched)
    context = {"model": ["+model=hf"], "input.prompt": ["+model=hf", "+input=text"],
               "input.context": ["+model=hf", "+input=text_dataset"],
               "source.prompt": ["+model=hf", "+source=text"]}  # fmt: skip
    for key in sorted(suggested):
        base = context.get(key, context["model"] if key.startswith("model.") else ["+model=cnn"])
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose("config", overrides=[*base, f"{key}=1"])
        assert OmegaConf.select(cfg, key) == 1, key


def test_reference_lists_model_and_input_keys() -> None:
    from surgery.app.build import MODEL_KEYS
    from surgery.app.inputs import INPUT_KINDS

    text = (REPO / "docs" / "config.md").read_text()
    model = text.split("## Model configs", 1)[1].split("\n## ", 1)[0]
    assert all(f"| `{key}` |" in model for key in MODEL_KEYS) and "`path`, `attn_implementation`" in model
    inputs = text.split("## Input keys", 1)[1].split("\n## ", 1)[0]
    for kind, keys in INPUT_KINDS.items():
        section = inputs.split(f"### `kind: {kind}`", 1)[1].split("\n### ", 1)[0]
        assert all(f"| `{key}` |" in section for key in keys), kind
    assert all(f"`{k}`" in inputs for k in ("x_key", "y_key", "limit", "batch_size", "prompts", "tokenizer"))


def test_gradient_maps_share_one_scale_centred_on_zero_and_activations_have_colour_bars() -> None:
    from surgery.app.plots import figure_of

    g = torch.arange(-8.0, 10.0).reshape(1, 2, 3, 3)  # channel 0 all negative, channel 1 mostly positive
    fig = figure_of(g, "a · m · grad_output.0", gradient=True)
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 2 and {im.get_cmap().name for im in images} == {"RdBu_r"}
    assert {im.get_clim() for im in images} == {(-9.0, 9.0)}  # one scale, symmetric about 0
    bars = [ax for ax in fig.axes if ax.get_ylabel().startswith("gradient")]
    assert len(bars) == 1
    fig = figure_of(g, "a · m · output")
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert [im.get_clim() for im in images] == [(-8.0, 0.0), (1.0, 9.0)]  # each on its own scale ...
    assert len(fig.axes) == 2 * len(images)  # ... each with its colour bar


def test_console_setup_quiets_hugging_face_progress_bars(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from surgery.app import cli

    for variable in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(sys, "argv", ["surgery"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    cli.main()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
    assert os.getcwd() in sys.path
    assert "model:" in capsys.readouterr().out


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_safe_logging_is_checked_again_when_hydra_applies_it() -> None:
    """Values resolvable only once the run starts (hydra.runtime): a file name passes, a class is refused, and the
    resolved config is checked again when Hydra configures logging."""
    from surgery.app import hydra_hooks

    def config(handler: dict) -> Any:
        return OmegaConf.create({"safe": True, "hydra": {"runtime": {}, "job_logging": {"handlers": {"h": handler}}}})

    late_file = config({"class": "logging.FileHandler", "filename": "${hydra.runtime.output_dir}/x.log"})
    hydra_hooks.check_logging(late_file)  # at compose time: the file name is not known yet, and harmless
    with pytest.raises(ConfigError, match=r"handlers\.h\.class: '\$\{hydra.runtime.handler\}' is not allowed"):
        hydra_hooks.check_logging(config({"class": "${hydra.runtime.handler}"}))
    called = []
    configure = hydra_hooks._guard_configure(lambda *args: called.append(args))
    late_class = config({"class": "${hydra.runtime.handler}"})
    late_class.hydra.runtime.handler = "evil.Handler"
    with pytest.raises(SystemExit) as stop:
        configure(late_class.hydra.job_logging, False)
    assert stop.value.code == 2 and not called
    late_file.hydra.runtime.output_dir = "run"
    configure(late_file.hydra.job_logging, False)
    assert len(called) == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+actions=linearize", "actions.linearise.fn=identity"],
         "error: actions.linearise: no such action in this run. Did you mean 'linearize'? Actions: linearize."
         " To add one: '+actions.linearise={kind: ..., select: ...}'.\n"),
        (["model.hiden=3"], "error: model.hiden: unknown key. Did you mean 'hidden'? Keys here: _target_, in_features,"
         " hidden, depth, out_features, activation, checkpoint, input. A new argument of model._target_ needs a +:"
         " +model.hiden=3\n"),
        (["sede=3"], "error: sede: unknown key. Did you mean 'seed' or "),
    ],
)  # fmt: skip
def test_override_typos_name_what_was_meant(
    overrides: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from surgery.app import hydra_hooks

    patched = hydra_hooks._patch_overrides(ConfigLoaderImpl._apply_overrides_to_config)
    monkeypatch.setattr(ConfigLoaderImpl, "_apply_overrides_to_config", patched)
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"), pytest.raises(SystemExit) as stop:
        compose("config", overrides=["+model=mlp", *overrides])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith(message)
