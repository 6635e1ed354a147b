"""A sample of scripts/hostile.py in the suite: each attack refused in one line, exit 2, nothing outside changed.

The whole corpus (one case per class of issue 38, timed, with peak RSS) runs as ``python -m scripts.hostile``;
docs/sharing.md reports its table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.hostile import CASES, run_case

SAMPLE = ("hydra_link", "now_format", "tokenizer_regex")


@pytest.mark.parametrize("case", [c for c in CASES if c.name in SAMPLE], ids=lambda c: c.name)
def test_a_hostile_case_is_refused_in_one_line(case, tmp_path: Path) -> None:
    result = run_case(case, tmp_path)
    assert result.passed, vars(result)
    assert not result.traceback and result.lines == 1
