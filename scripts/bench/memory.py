"""Peak memory of capturing every layer over 100 batches: kept in memory vs streamed to disk.

Each case runs in a fresh child process and reports its own peak RSS (``ru_maxrss``) and its
RSS before the first batch, so the difference is what the captures (and the run) added:

* ``api``: ``surgery.apply`` with a capture of every module of the CNN (batch 32), 100 forwards;
  ``memory`` keeps every call in ``s.captures``; ``disk`` is the ``to: disk`` capture with
  ``Surgery.flush(dir)`` after each batch (one safetensors shard per batch); ``none`` runs the
  same forwards without surgery (the floor).
* ``cli``: ``python -m surgery +model=cnn +actions=capture +input.batches=100`` at batch 32, with
  and without ``+actions.capture.to=disk`` (the whole job: captures.safetensors written at the end
  in memory mode, one shard per batch in disk mode).

    python -m scripts.bench.memory [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench.common import ROOT, machine, run_child, write_json

BATCH = 32
EVERY_MODULE = {"cap": {"kind": "capture", "select": "**", "exclude": "<root>"}}


def rss_mib() -> float:
    """Resident set size of this process now."""
    return status_mib("VmRSS")


def peak_mib() -> float:
    """This process's own peak RSS since it started (``VmHWM``). Not ``ru_maxrss``: Linux carries that over from the
    parent at fork, so a child of a process holding a large model would report the parent's size."""
    return status_mib("VmHWM")


def status_mib(key: str) -> float:
    """A size line of /proc/self/status (``VmRSS``, ``VmHWM``) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(mode: str, batches: int, directory: str) -> dict[str, Any]:
    """One API case in this (fresh) process: build, apply, run ``batches`` forwards, report memory."""
    sys.path.insert(0, str(ROOT))
    import torch

    import surgery
    from surgery.app.forwards import write_shard
    from surgery.models.cnn import CNN

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CNN().eval()
    xs = torch.randn(batches, BATCH, 1, 28, 28)  # allocated up front so it is part of the floor
    actions = {"cap": {**EVERY_MODULE["cap"], "to": "disk"}} if mode == "disk" else EVERY_MODULE
    s = surgery.apply(model, actions) if mode != "none" else None
    with torch.no_grad():
        model(xs[0])  # first call: lazy allocations of torch itself belong to the floor
    model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    one_batch = 0  # what one forward's captures hold: the yardstick for streaming to disk
    if s is not None:
        for records in s.captures.values():
            for record in records.values():
                one_batch += sum(c.output.numel() * c.output.element_size() for c in record.calls)
                record.calls.clear()
    before = rss_mib()
    start = time.perf_counter()
    shards = 0
    with torch.no_grad():
        for i in range(batches):
            model(xs[i])
            if mode == "disk" and s is not None:
                shards += write_shard(s, Path(directory), shards)
    seconds = time.perf_counter() - start
    held = 0
    if s is not None:
        storages = {}
        for records in s.captures.values():
            for record in records.values():
                for call in record.calls:
                    if isinstance(call.output, torch.Tensor):
                        storage = call.output.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
        held = sum(storages.values())
        s.remove()
    on_disk = sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "mode": mode,
        "batches": batches,
        "rss_before_mib": before,
        "peak_rss_mib": peak,
        "added_mib": peak - before,
        "held_in_captures_mib": held / 2**20,
        "model_mib": model_bytes / 2**20,
        "one_batch_mib": one_batch / 2**20,
        "on_disk_mib": on_disk / 2**20,
        "shards": shards,
        "seconds": seconds,
    }


def api_case(mode: str, batches: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        child = [sys.executable, "-m", "scripts.bench.memory", "--child", mode, "--batches", str(batches)]
        run = run_child([*child, "--dir", directory], cwd=ROOT)
    return json.loads(run.stdout.strip().splitlines()[-1])


def cli_case(mode: str, batches: int) -> dict[str, Any]:
    """The whole CLI job in a child process, and its peak RSS."""
    with tempfile.TemporaryDirectory() as directory:
        args = [
            sys.executable,
            "-m",
            "surgery",
            "+model=cnn",
            "+input=random",  # the cnn's default input is the digits data set; this measures batches of noise
            "+actions=capture",
            f"+input.batches={batches}",
            f"+input.shape=[{BATCH},1,28,28]",
            "compare=false",
            f"hydra.run.dir={directory}",
        ]
        if mode == "disk":
            args.append("+actions.capture.to=disk")
        run = run_child(args, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
        files = list(Path(directory).rglob("*.safetensors"))
        return {
            "mode": mode,
            "batches": batches,
            "peak_rss_mib": run.peak_rss_mib,
            "on_disk_mib": sum(p.stat().st_size for p in files) / 2**20,
            "files": len(files),
            "seconds": run.wall_s,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 batches, API only")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=["none", "memory", "disk"], help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=100, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batches, args.dir)))
        return 0
    batches = 10 if args.quick else 100
    api = [api_case(mode, batches) for mode in ("none", "disk", "memory")]
    for row in api:
        print(
            f"api {row['mode']:6} peak {row['peak_rss_mib']:7.1f} MiB  added {row['added_mib']:7.1f} MiB"
            f"  held {row['held_in_captures_mib']:7.1f} MiB  on disk {row['on_disk_mib']:7.1f} MiB",
            flush=True,
        )
    cli = [] if args.quick else [cli_case(mode, batches) for mode in ("disk", "memory")]
    for row in cli:
        print(f"cli {row['mode']:6} peak {row['peak_rss_mib']:7.1f} MiB  on disk {row['on_disk_mib']:7.1f} MiB")
    write_json(args.json, {"machine": machine(), "batch": BATCH, "api": api, "cli": cli})
    return 0


if __name__ == "__main__":
    sys.exit(main())
