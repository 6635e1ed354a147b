"""Re-run a run from its saved config and check that every fingerprint comes out the same.

    python -m surgery.app.replay outputs/2026-11-22/04-32-50            # into a temporary directory
    python -m surgery.app.replay RUN_DIR --out replayed/                 # keep the new run's files

Reads ``RUN_DIR/.hydra/config.yaml`` (the composed job config Hydra saved), runs it with
``surgery.app.job.run_job`` (no Hydra runtime involved) and compares the new report's
fingerprints with ``RUN_DIR/report.json``. Start it from the directory the original run
was started from: relative paths in the config (``input.path``, ``model.checkpoint``,
``from.file``) are read from there. Exit 0: all identical; 1: any differs; 2: bad input.

Where a fingerprint differs, replay also says by how much, from the tensors both runs saved:
``output`` from ``output.safetensors`` (batch 0's output), ``state_dict_after`` from
``model.safetensors`` (``save_model=true``), and the captures from ``captures.safetensors``;
and it names what differs in the environment (CPU, its vector capability, torch, python, device).

A run directory may come from someone else, so its config runs under ``safe=true`` whatever it says
(docs/sharing.md): its resolvers, ``_target_`` nodes and sizes are checked before anything runs.
``--trust`` runs it as saved. The ``config`` fingerprint compared is the saved config's own.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from surgery.errors import EXIT_BAD_INPUT, EXIT_OK, ReplayError, SurgeryError
from surgery.files import gate

EXIT_SAME = EXIT_OK
EXIT_DIFFERENT = 1  # replay's own answer: the fingerprints differ (not an internal failure)
SHORT = 12
MEASURED_BY = {"output": "output.safetensors", "state_dict_after": "model.safetensors"}  # fingerprint: file
ENVIRONMENT_KEYS = ("cpu", "cpu_capability", "torch", "python", "device")


def load_run(run_dir: Path) -> tuple[DictConfig, dict[str, Any]]:
    """The saved job config and the report (with fingerprints) of a run directory, checked."""
    if not run_dir.is_dir():
        raise ReplayError(f"{run_dir}: no such directory")
    config_file, report_file = run_dir / ".hydra" / "config.yaml", run_dir / "report.json"
    for needed in (config_file, report_file):
        if not needed.is_file():
            raise ReplayError(
                f"{run_dir}: no {needed.relative_to(run_dir)}; is this a run directory of `python -m surgery`?"
            )
    from surgery.files import gate
    from surgery.safe import yaml_guard

    yaml_guard.install()  # an alias bomb in the saved config is refused as it is read, before it expands
    try:
        text = gate.read_text(config_file, str(config_file), what="a saved job config")
        report = gate.read_json_object(report_file, str(report_file))
        cfg = OmegaConf.create(text)
    except SurgeryError as e:  # the YAML guard names the text it read; say which file that was
        raise ReplayError(str(e).replace("<unicode string>", str(config_file))) from None
    except Exception as e:  # noqa: BLE001 - any parse failure is bad input
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise ReplayError(f"{run_dir}: cannot read the saved run ({type(e).__name__}: {first})") from None
    if not isinstance(cfg, DictConfig) or cfg.get("model") is None:
        raise ReplayError(f"{config_file}: not a surgery job config (no model)")
    prints = report.get("fingerprints")
    if not isinstance(prints, dict) or not prints or not all(isinstance(v, str) for v in prints.values()):
        raise ReplayError(f"{report_file}: holds no fingerprints to compare (a table of names to hashes)")
    if not isinstance(report.get("environment", {}), dict):
        raise ReplayError(f"{report_file}: its environment is not a table; not a report surgery wrote")
    return cfg, report


def compare(old: dict[str, str], new: dict[str, Any]) -> dict[str, bool]:
    """{fingerprint: identical?} for every fingerprint of the original report."""
    return {name: new.get(name) == value for name, value in old.items()}


def table(
    old: dict[str, str], new: dict[str, Any], same: dict[str, bool], amounts: dict[str, str] | None = None
) -> str:
    """An aligned table: fingerprint, identical/different, both short hashes and by how much where they differ."""
    width = max(len(name) for name in same)
    lines = []
    for name, ok in same.items():
        line = f"{name:<{width}}  {'identical' if ok else 'different'}"
        if not ok:
            amount = f"; {amounts[name]}" if amounts and name in amounts else ""
            line += f"  (was {str(old[name])[:SHORT]}, now {str(new.get(name, 'missing'))[:SHORT]}{amount})"
        lines.append(line)
    return "\n".join(lines)


def max_difference(old_file: Path, new_file: Path) -> tuple[float, str] | str:
    """(max abs difference, the key where it is) over two safetensors files, or why they cannot be compared."""
    from surgery.files.tensors import read_tensors

    if not old_file.is_file() or not new_file.is_file():
        missing = old_file if not old_file.is_file() else new_file
        return f"no {missing.name} in {missing.parent} to measure by"
    try:
        old, new = read_tensors(old_file, str(old_file)), read_tensors(new_file, str(new_file))
    except SurgeryError as e:  # a damaged file: say so in the table rather than fail the comparison
        return str(e)
    if old.keys() != new.keys():
        return f"{old_file.name}: the runs saved different tensors ({len(old)} vs {len(new)} keys)"
    worst, where = 0.0, ""
    for key, tensor in old.items():
        if tensor.shape != new[key].shape:
            return f"{old_file.name}: {key} is {list(tensor.shape)}, now {list(new[key].shape)}"
        if tensor.numel() and not torch.equal(tensor, new[key]):
            gap = (tensor.double() - new[key].double()).abs().max().item()
            if gap > worst or not where:
                worst, where = gap, key
    return worst, where


def measure(run_dir: Path, out_dir: Path, differ: list[str]) -> dict[str, str]:
    """{fingerprint: 'max |difference| X in KEY'} for the differing fingerprints a saved file can measure."""
    amounts = {}
    for name in differ:
        if name not in MEASURED_BY:
            continue
        found = max_difference(run_dir / MEASURED_BY[name], out_dir / MEASURED_BY[name])
        if isinstance(found, str):
            amounts[name] = found
        elif found[1]:
            amounts[name] = f"max |difference| {found[0]:.3g} in {found[1]}"
        else:
            amounts[name] = f"{MEASURED_BY[name]} identical (batch 0); a later batch differs"
    return amounts


def captures_line(run_dir: Path, out_dir: Path) -> str | None:
    """One line on how much the captures differ, when both runs saved some and they are not identical."""
    name = "captures.safetensors"
    if not (run_dir / name).is_file() or not (out_dir / name).is_file():
        return None
    found = max_difference(run_dir / name, out_dir / name)
    if isinstance(found, str):
        return found
    return f"{name}: max |difference| {found[0]:.3g} in {found[1]}" if found[1] else None


def environment_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between the original run's environment and this one (``cpu: A -> B``)."""
    changes = []
    for key in ENVIRONMENT_KEYS:
        if key not in old and key in new:
            changes.append(f"{key}: not recorded by the original run, now {new[key]!r}")
        elif old.get(key) != new.get(key):
            changes.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return changes


def untrusted(cfg: DictConfig) -> DictConfig:
    """The saved config as replay runs it without ``--trust``: checked as safe mode checks a composed config, and
    with ``safe: true`` whatever the file says."""
    from surgery.safe.interpolations import check_interpolations

    check_interpolations(OmegaConf.to_container(cfg, resolve=False), safe=True)
    from surgery.safe.config_paths import check_config_paths

    check_config_paths(OmegaConf.to_container(cfg, resolve=False), set(), hint="; replay --trust runs it as saved")
    forced = cfg.copy()
    forced.safe = True
    return forced


def replay(run_dir: Path, out_dir: Path, trust: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the saved config of ``run_dir`` into ``out_dir`` (under safe=true unless ``trust``); both reports.

    The job's own prints (plan table, summary line) go to stderr, so stdout holds the comparison.
    """
    from surgery.app.job import run_job
    from surgery.app.report import fingerprint

    cfg, old = load_run(run_dir)
    with contextlib.redirect_stdout(sys.stderr):
        report = run_job(cfg if trust else untrusted(cfg), out_dir, None if trust else set())
    if not trust and isinstance(report.get("fingerprints"), dict):  # the saved config's, not the forced copy's
        report["fingerprints"]["config"] = fingerprint(OmegaConf.to_container(cfg, resolve=True))
    return old, report


def main(argv: list[str] | None = None) -> int:
    """``python -m surgery.app.replay RUN_DIR [--out DIR] [--trust]``: 0 all identical, 1 any different, 2 bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m surgery.app.replay",
        description="Re-run RUN_DIR/.hydra/config.yaml and compare every fingerprint with RUN_DIR/report.json."
        " Start it from the directory the original run started in (relative paths in the config).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding report.json and .hydra/")
    parser.add_argument("--out", default=None, help="write the new run here (default: a temporary directory)")
    parser.add_argument(
        "--trust", action="store_true", help="run the saved config as it is, not under safe=true (only if you trust it)"
    )
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if args.out is not None and Path(args.out).resolve() == run_dir.resolve():
        print("error: --out must not be RUN_DIR itself (its report would be overwritten)", file=sys.stderr)
        return EXIT_BAD_INPUT
    out_dir = Path(args.out) if args.out is not None else gate.temp_dir("surgery-replay-")
    keep = args.out is not None
    try:
        old_report, new_report = replay(run_dir, out_dir, trust=args.trust)
    except (ReplayError, SurgeryError, OmegaConfBaseException, RecursionError) as e:
        from surgery.app.hydra_messages import NESTED_TOO_DEEPLY, printable

        text = NESTED_TOO_DEEPLY if isinstance(e, RecursionError) else str(e)
        hint = ""
        if isinstance(e, SurgeryError) and "does not exist" in text:
            hint = " (relative paths are read from the current directory: start replay where the run started)"
        elif isinstance(e, OmegaConfBaseException):
            hint = " (an interpolation the saved config cannot resolve without Hydra's runtime?)"
        elif not args.trust and ("safe=true" in text or "limits." in text):
            hint = " (replay runs a saved config under safe=true; if you trust RUN_DIR, --trust runs it as saved)"
        print(f"error: {printable(text + hint)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception:
        traceback.print_exc()
        print("error: the replayed run failed unexpectedly (exit 1)", file=sys.stderr)
        return EXIT_DIFFERENT
    finally:
        if not keep and not (out_dir / "report.json").is_file():
            gate.remove_tree(out_dir)
    old, new = old_report["fingerprints"], new_report.get("fingerprints", {})
    same = compare(old, new)
    differ = [name for name, ok in same.items() if not ok]
    print(table(old, new, same, measure(run_dir, out_dir, differ)))
    changes = environment_changes(old_report.get("environment") or {}, new_report.get("environment") or {})
    if changes and "environment" in old_report:  # a plan run records none
        print(f"another environment than the original run's: {'; '.join(changes)}")
    line = captures_line(run_dir, out_dir) if differ else None
    if line:
        print(line)
    if not differ:
        if keep:
            print(f"all {len(same)} fingerprints identical; new run in {out_dir}")
        else:
            gate.remove_tree(out_dir)
            print(f"all {len(same)} fingerprints identical (the temporary new run is removed; --out DIR keeps one)")
        return EXIT_SAME
    print(f"{len(differ)} of {len(same)} fingerprints different: {', '.join(differ)}; new run in {out_dir}")
    return EXIT_DIFFERENT
