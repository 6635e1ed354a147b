"""The benchmarks, one package: ``python -m scripts.bench`` runs them all and rewrites BENCHMARKS.md.

overhead.py (hook overhead against hand-written hooks, with peers.py), cases.py (the models and
tasks both time), plan.py, memory.py, compile.py, startup.py; common.py holds the timing; report/
renders BENCHMARKS.md; venv.py sets up ``.venv-bench``. Each module also runs alone
(``python -m scripts.bench.overhead --help``).
"""
