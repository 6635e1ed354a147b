"""``.venv-bench``: the package plus the peers (nnsight, pyvene, TransformerLens), apart from the dev venv.

torch is pinned to 2.13.0 in every pip call: it resolves to the CPU build, while anything open
pulls CUDA wheels (GBs). A peer that does not install is left out (BENCHMARKS.md says so);
transformer-lens 4.x has no HookedTransformer, hence 3.9.0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VENV = ROOT / ".venv-bench"
PINS = ["torch==2.13.0", "hydra-core==1.3.8"]
PEERS = ["nnsight==0.8.1", "pyvene==0.1.8", "transformer-lens==3.9.0"]
STAMP = VENV / ".surgery-installed"


def in_bench_venv() -> bool:
    """Whether this interpreter is the bench venv's."""
    return Path(sys.prefix).resolve() == VENV.resolve()


def _stale() -> bool:
    if not STAMP.is_file():
        return True
    inputs = [ROOT / "pyproject.toml", Path(__file__)]
    return any(p.stat().st_mtime > STAMP.stat().st_mtime for p in inputs)


def setup() -> Path:
    """Create or refresh ``.venv-bench``; its python."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    if _stale():
        log = VENV / "setup.log"
        print(f"setting up {VENV.name} (log: {log}) ...", flush=True)
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        with log.open("w") as out:
            if subprocess.run([*pip, "-e", ".[hf,lightning]", *PINS], cwd=ROOT, stdout=out, stderr=out).returncode:
                sys.exit(f"set-up failed; full log in {log}")
            for peer in PEERS:  # one at a time: a peer that fails is left out, not the others
                if subprocess.run([*pip, peer, *PINS], cwd=ROOT, stdout=out, stderr=out).returncode:
                    print(f"warning: {peer} did not install; it is left out of the benchmarks", file=sys.stderr)
        version = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                 text=True).stdout.strip()  # fmt: skip
        if version != "2.13.0+cpu":
            sys.exit(f"a peer moved torch away from 2.13.0+cpu (now {version!r}); see {log}")
        STAMP.touch()
    return python


def reexec_in_bench_venv(args: list[str]) -> None:
    """Replace this process with ``python -m scripts.bench ARGS`` in the bench venv."""
    python = setup()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(VENV / "inductor-cache"))  # warm after the first run
    os.chdir(ROOT)
    os.execv(str(python), [str(python), "-m", "scripts.bench", *args])
