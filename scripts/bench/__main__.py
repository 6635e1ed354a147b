"""``python -m scripts.bench [--quick] [--only overhead,plan] [--render]``: every benchmark, then BENCHMARKS.md.

``python -m scripts.bench --gpu --out DIR``: the GPU benchmarks (scripts/bench/gpu.py) on a CUDA machine.

Run from the repository root with any python 3.10+: it sets up ``.venv-bench`` (the package plus
the peers) when needed and runs the benchmarks there; ``--only study --merge`` runs in this python and
rewrites only that benchmark's part of BENCHMARKS.md.
"""

from __future__ import annotations

import sys

from scripts.bench.venv import in_bench_venv, reexec_in_bench_venv

if __name__ == "__main__":
    if "--gpu" in sys.argv:  # the GPU benchmarks: in this python (the GPU machine's), peers not needed
        from scripts.bench.gpu import main as gpu_main

        sys.exit(gpu_main(sys.argv[1:]))
    if not in_bench_venv() and "--merge" not in sys.argv:  # one benchmark merged needs no peers
        reexec_in_bench_venv(sys.argv[1:])  # does not return
    from scripts.bench.report import main

    sys.exit(main())
