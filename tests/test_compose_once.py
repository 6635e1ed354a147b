"""A CLI run composes its config once (Hydra alone composes it twice: once to read ``hydra.mode``, once to run).

The config the run gets, and what it writes in ``.hydra/``, are the same as with Hydra's own two compositions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DRIVER = """
import json, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
import surgery.app.cli as cli

modes = []
compose = ConfigLoaderImpl._load_configuration_impl
def counted(self, config_name, overrides, run_mode, *args, **kwargs):
    modes.append(run_mode.name)
    return compose(self, config_name, overrides, run_mode, *args, **kwargs)
ConfigLoaderImpl._load_configuration_impl = counted
counts = {}
for name, args in json.loads(sys.argv[1]).items():
    if name == "hydra":  # Hydra's own get_mode: compose to read hydra.mode, then again to run
        from surgery.app.hydra_hooks import install
        install()
        Hydra.get_mode = Hydra.get_mode.surgery_original
    modes.clear()
    sys.argv = ["surgery", *args]
    try:
        cli.main()
    except SystemExit as e:
        modes.append(f"exit {e.code}")
    counts[name] = list(modes)
print(json.dumps(counts))
"""


def run_both(tmp_path: Path, *args: str) -> dict[str, list[str]]:
    runs = {name: [*args, f"hydra.run.dir={tmp_path / name}"] for name in ("once", "hydra")}
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(runs)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_run_composes_once_and_writes_what_two_compositions_wrote(tmp_path: Path) -> None:
    counts = run_both(tmp_path, "+model=mlp", "+actions=capture", "mode=plan")
    assert counts == {"once": ["RUN"], "hydra": ["MULTIRUN", "RUN"]}
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        once = (tmp_path / "once" / ".hydra" / name).read_text().replace(str(tmp_path / "once"), "DIR")
        hydra = (tmp_path / "hydra" / ".hydra" / name).read_text().replace(str(tmp_path / "hydra"), "DIR")
        assert once == hydra, name
    assert "- hydra.mode=RUN" in (tmp_path / "once" / ".hydra" / "hydra.yaml").read_text()
    report = json.loads((tmp_path / "once" / "report.json").read_text())
    assert report["plan"] == json.loads((tmp_path / "hydra" / "report.json").read_text())["plan"]


def test_a_run_hydra_refuses_is_refused_as_before(tmp_path: Path) -> None:
    counts = run_both(tmp_path, "+model=mlp", "+actions=capture", "seed=0,1")  # a sweep value without -m
    assert counts["once"][-1] == counts["hydra"][-1] == "exit 2"
