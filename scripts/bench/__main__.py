"""``python -m scripts.bench [--quick] [--only overhead,plan] [--render]``: every benchmark, then BENCHMARKS.md.

Run from the repository root with any python 3.10+: it sets up ``.venv-bench`` (the package plus
the peers) when needed and runs the benchmarks there; ``--only study --merge`` runs in this python and
rewrites only that benchmark's part of BENCHMARKS.md.
"""

from __future__ import annotations

import sys

from scripts.bench.venv import in_bench_venv, reexec_in_bench_venv

if __name__ == "__main__":
    if not in_bench_venv() and "--merge" not in sys.argv:  # one benchmark merged needs no peers
        reexec_in_bench_venv(sys.argv[1:])  # does not return
    from scripts.bench.report import main

    sys.exit(main())
