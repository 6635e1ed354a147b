"""Reading a sweep directory that may come from someone else: its job directories, reports and overrides.

Every file goes through :mod:`surgery.files.gate` (no link leaves the sweep, sizes are capped), and what the
summary reads from a report must have the report's shapes; anything else is one SweepError naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from surgery.errors import SurgeryError, SweepError
from surgery.files import gate

MAX_REPORT_BYTES = 64 * 2**20  # a report.json is kilobytes; a bigger file is not one
MAX_ENTRIES = 1_000_000  # entries looked at when searching a directory for nested sweeps


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One dict per job dir, sorted by job number: ``job``, ``dir``, ``overrides`` {name: value}, ``report``.

    ``report`` is the parsed ``report.json``, or ``None`` for a job that wrote none (it failed
    or never ran). Override names lose their ``+``/``++`` prefix; ``~name`` (a deletion) gives
    the value ``"~"``.

    >>> [job["overrides"]["actions.scale_output.value"] for job in collect("multirun/...")]  # doctest: +SKIP
    ['0.5', '1', '2']
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise SweepError(f"{root}: no such directory")
    try:
        dirs = [root / name for name in gate.listing(root, str(root))]
        dirs = [d for d in dirs if d.is_dir() and _is_job_dir(d)]
        for d in dirs:  # a job directory linked from elsewhere is not this sweep's
            gate.member(root, d.name, str(root), "a job directory")
    except SurgeryError as e:
        raise SweepError(str(e)) from None
    if not any((d / "report.json").is_file() for d in dirs):
        raise SweepError(_no_reports_message(root))
    jobs = []
    for d in sorted(dirs, key=_job_order):
        report = read_report(d / "report.json")
        jobs.append({"job": d.name, "dir": str(d), "overrides": read_overrides(d), "report": report})
    return jobs


def read_report(report_file: Path) -> dict[str, Any] | None:
    """A job's ``report.json`` as a dict, None when it wrote none; a file that is not a report is a SweepError.

    A sweep directory may come from someone else: the file is size-checked, must hold a JSON object,
    and what the summary reads from it (``mode``, ``metrics``) must have the report's shapes.
    """
    if not report_file.is_file():
        return None
    try:
        report = gate.read_json(report_file, str(report_file), MAX_REPORT_BYTES)
    except SurgeryError as e:
        raise SweepError(f"{e} (not a readable report)") from None
    if not isinstance(report, dict):
        raise SweepError(f"{report_file}: not a report (a JSON object expected, found {type(report).__name__})")
    if not isinstance(report.get("mode", "run"), str):
        raise SweepError(f"{report_file}: not a report (mode is a {type(report['mode']).__name__}, not a name)")
    for model in ("surgered", "unmodified", "delta"):
        found = lookup(report, f"metrics.{model}")
        if found is not None and not isinstance(found, dict):
            raise SweepError(f"{report_file}: not a report (metrics.{model} is a {type(found).__name__}, not a table)")
    if report.get("metrics") is not None and not isinstance(report["metrics"], dict):
        raise SweepError(f"{report_file}: not a report (metrics is a {type(report['metrics']).__name__}, not a table)")
    return report


def read_overrides(job_dir: Path) -> dict[str, str]:
    """A job's command-line overrides from ``.hydra/overrides.yaml`` as {name: value}; empty if absent."""
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    from surgery.safe import yaml_guard

    yaml_guard.install()  # an alias bomb is refused as it is read
    try:
        text = gate.read_text(path, str(path), what="Hydra's list of overrides")
        lines = OmegaConf.to_container(OmegaConf.create(text), resolve=False) or []
    except SurgeryError as e:
        raise SweepError(str(e).replace("<unicode string>", str(path))) from None
    except Exception as e:  # noqa: BLE001 - YAML or OmegaConf refusing the file: it is not Hydra's
        raise SweepError(f"{path}: not Hydra's list of overrides ({type(e).__name__})") from None
    if not isinstance(lines, list):
        raise SweepError(f"{path}: not Hydra's list of overrides (found a {type(lines).__name__})")
    overrides: dict[str, str] = {}
    for line in lines:
        name, sep, value = str(line).partition("=")
        if name.startswith("~"):
            overrides[name[1:]] = "~"
            continue
        overrides[name.lstrip("+")] = value if sep else ""
    return overrides


def lookup(report: dict[str, Any] | None, path: str) -> Any:
    """The value at a dotted path in a report (list items by index), or ``None`` when absent."""
    value: Any = report
    for part in path.split("."):
        if isinstance(value, dict):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _is_job_dir(path: Path) -> bool:
    return (path / "report.json").is_file() or (path / ".hydra" / "overrides.yaml").is_file()


def _job_order(path: Path) -> tuple[int, int, str]:
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def _no_reports_message(root: Path) -> str:
    try:
        found = [p.relative_to(root) for p in gate.walk(root, str(root), "report.json", MAX_ENTRIES)]
    except SurgeryError as e:
        raise SweepError(str(e)) from None
    reports = [p for p in found if p.name == "report.json"]
    nested = sorted({str(p.parent.parent) for p in reports if len(p.parts) == 4})
    nested += sorted({str(p.parent.parent) for p in reports if len(p.parts) == 3})
    if nested:
        return f"{root}: no job reports directly inside (DIR/N/report.json); sweeps inside it: {', '.join(nested)}"
    return f"{root}: no job reports (DIR/N/report.json) found; is this a sweep directory (hydra.sweep.dir)?"
