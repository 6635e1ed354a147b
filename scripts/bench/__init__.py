"""The benchmarks, one package: ``python -m scripts.bench`` runs them all and rewrites BENCHMARKS.md.

overhead.py (hook overhead against hand-written hooks, with peers.py), cases.py (the models and
tasks both time), plan.py (to 1M modules), memory.py, compile.py, startup.py, data.py, lm.py,
training.py, meta.py (a 70B-class Llama planned on meta from the CLI), ddp.py (DDP on 2 ranks
under torchrun); common.py holds the timing; report/
renders BENCHMARKS.md; venv.py sets up ``.venv-bench``. Each module also runs alone
(``python -m scripts.bench.overhead --help``).
"""
