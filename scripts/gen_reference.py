"""Write docs/config.md and docs/expressions.md from the code: schemas, kind registry, conf/ and surgery/expr/.

``python scripts/gen_reference.py`` writes both; ``--check`` exits 1 when either is out of date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # document this checkout's code, even where another surgery is installed

from scripts.reference.config import render  # noqa: E402
from scripts.reference.expression_cases import EXAMPLES, GRAMMAR, PLACES, REFUSED  # noqa: E402
from scripts.reference.expressions import render_expressions  # noqa: E402

__all__ = ["EXAMPLES", "GRAMMAR", "PLACES", "REFUSED", "main", "render", "render_expressions"]
DOC = ROOT / "docs" / "config.md"
EXPR_DOC = ROOT / "docs" / "expressions.md"


def main(argv: list[str] | None = None) -> int:
    """Write docs/config.md and docs/expressions.md, or with ``--check`` return 1 when either is out of date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated doc is out of date")
    args = parser.parse_args(argv)
    docs = {DOC: render(), EXPR_DOC: render_expressions()}
    if args.check:
        stale = [path.name for path, text in docs.items() if not path.is_file() or path.read_text() != text]
        for name in stale:
            print(f"{name} is out of date: run python scripts/gen_reference.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in docs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
