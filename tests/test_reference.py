"""docs/config.md is generated from the code (scripts/gen_reference.py); these tests keep it true."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from surgery.actions import KINDS
from surgery.schema import RunSettings

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gen_reference.py"


def load_script():
    """Import scripts/gen_reference.py by path: scripts/ is not a package."""
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_reference = load_script()


def test_doc_is_up_to_date():
    assert gen_reference.DOC.read_text() == gen_reference.render(), "run: python scripts/gen_reference.py"


def test_doc_names_every_kind_and_run_setting():
    text = gen_reference.DOC.read_text()
    assert [name for name in KINDS.names() if f"### `{name}`" not in text] == []
    assert [f.name for f in dataclasses.fields(RunSettings) if f"| `{f.name}` |" not in text] == []


def test_check_fails_on_a_stale_doc(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("# Config reference\n")
    monkeypatch.setattr(gen_reference, "DOC", stale)
    assert gen_reference.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err
    assert gen_reference.main([]) == 0
    assert gen_reference.main(["--check"]) == 0
