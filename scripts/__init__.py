"""Developer scripts: benchmarks (``python -m scripts.bench``) and the reference generator (gen_reference.py)."""
