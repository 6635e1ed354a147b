"""Collect the reports of a ``-m`` sweep into ``summary.csv``, ``summary.md`` and a plot.

    python -m surgery.app.sweep multirun/2026-11-22/04-32-50
    python -m surgery.app.sweep DIR --metric difference.mse --x actions.scale_output.value

DIR is one sweep: Hydra's ``hydra.sweep.dir``, holding a run directory per job
(``DIR/0``, ``DIR/1``, ...) with its ``report.json`` and ``.hydra/overrides.yaml``.
From Python: ``jobs = collect(DIR)``; ``summary_rows(jobs)`` gives the table's rows.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import io
import sys
from pathlib import Path
from typing import Any

from surgery.app.sweep_plots import heatmap_cells, plot_heatmaps, plot_metric, plot_metrics, too_large
from surgery.app.sweep_read import collect, lookup
from surgery.errors import EXIT_BAD_INPUT, SweepError
from surgery.files.write import write_text

DEFAULT_METRIC = "difference.max_abs"
METRICS = ("difference.max_abs", "difference.mean_abs", "difference.mse", "difference.kl", "output.mean", "output.std")
FINGERPRINT_CHARS = 12


def varying(jobs: list[dict[str, Any]]) -> list[str]:
    """The override names whose value is not the same in every job, in command-line order."""
    names = _override_names(jobs)
    return [n for n in names if len({job["overrides"].get(n) for job in jobs}) > 1]


def summary_rows(jobs: list[dict[str, Any]], extra_metric: str | None = None) -> list[dict[str, Any]]:
    """One flat row per job: job, status, overrides, difference metrics, output stats, restored, output print."""
    names = metric_names(jobs)
    metrics = [m for m in METRICS if any(_number(lookup(job["report"], m)) is not None for job in jobs)]
    if extra_metric and extra_metric not in metrics:
        metrics.append(extra_metric)
    rows = []
    for job in jobs:
        report = job["report"]
        row: dict[str, Any] = {"job": job["job"], "status": _status(report)}
        row.update({name: job["overrides"].get(name, "") for name in _override_names(jobs)})
        row.update({m: _cell(lookup(report, m)) for m in metrics})
        for model in ("surgered", "unmodified", "delta"):
            row.update({f"metrics.{model}.{m}": _cell(lookup(report, f"metrics.{model}.{m}")) for m in names})
        row["restored"] = _cell(lookup(report, "restored"))
        output_print = lookup(report, "fingerprints.output")
        row["fingerprints.output"] = output_print[:FINGERPRINT_CHARS] if isinstance(output_print, str) else ""
        rows.append(row)
    return rows


def metric_names(jobs: list[dict[str, Any]]) -> list[str]:
    """The names of the metrics (report.json's ``metrics``) any job has, in first-seen order."""
    names: dict[str, None] = {}
    for job in jobs:
        for model in ("surgered", "unmodified"):
            names.update(dict.fromkeys(lookup(job["report"], f"metrics.{model}") or {}))
    return list(names)


def write_summary(
    sweep_dir: str | Path, metric: str | None = None, x: str | None = None, plot: bool = True,
    notes: list[str] | None = None,
) -> list[Path]:  # fmt: skip
    """Collect, check metric and x, write ``summary.csv``, ``summary.md``, ``summary.png``; return the paths.

    Without ``metric``, a sweep whose reports hold metrics plots every metric (a heatmap per metric when
    two overrides vary); other sweeps plot ``difference.max_abs``.
    """
    root = Path(sweep_dir)
    return write_collected(root, collect(root), metric, x, plot, notes)


def write_collected(
    root: Path, jobs: list[dict[str, Any]], metric: str | None, x: str | None, plot: bool,
    notes: list[str] | None = None,
) -> list[Path]:  # fmt: skip
    """``write_summary`` for collected jobs; when plotting, nothing is written unless metric and x are usable.

    A figure too large to draw (:func:`too_large`) is left out: ``notes`` (and summary.md) say why.
    """
    notes = [] if notes is None else notes
    if metric is None and metric_names(jobs):
        return write_metric_summary(root, jobs, x, plot, notes)
    metric = metric or DEFAULT_METRIC
    points = metric_points(jobs, metric) if plot else {}
    axis = choose_x(jobs, x, points) if plot else None
    has_metric = plot or any(lookup(job["report"], metric) is not None for job in jobs)
    rows = summary_rows(jobs, metric if has_metric else None)
    why = too_large(1, points=len(points)) if axis is not None else None
    if why is not None:
        notes.append(_not_drawn(why))
    written = _write_tables(root, rows, notes)
    if axis is not None and why is None:
        written.append(root / "summary.png")
        plot_metric(written[2], points, metric, axis)
    return written


def write_metric_summary(
    root: Path, jobs: list[dict[str, Any]], x: str | None, plot: bool, notes: list[str] | None = None
) -> list[Path]:
    """summary.csv/.md with every metric, and summary.png: each metric over the sweep (heatmaps over two keys)."""
    notes = [] if notes is None else notes
    rows = summary_rows(jobs)
    if not plot:
        return _write_tables(root, rows, notes)
    names = metric_names(jobs)
    values = {m: metric_points(jobs, f"metrics.surgered.{m}") for m in names if _any_number(jobs, m)}
    first = _first_report(jobs)
    baseline = {m: v for m in values if (v := _number(lookup(first, f"metrics.unmodified.{m}"))) is not None}
    changing = varying(jobs)
    path = root / "summary.png"
    if x is None and len(changing) == 2:
        rows_of = {job["job"]: str(job["overrides"].get(changing[0], "")) for job in jobs}
        cols_of = {job["job"]: str(job["overrides"].get(changing[1], "")) for job in jobs}
        why = too_large(len(values), cells=heatmap_cells(rows_of, cols_of))
        draw = lambda: plot_heatmaps(path, values, rows_of, cols_of, (changing[0], changing[1]))  # noqa: E731
    else:
        any_points = next(iter(values.values()))
        why = too_large(len(values), points=len(any_points))
        axis = choose_x(jobs, x, any_points) if why is None else {}
        draw = lambda: plot_metrics(path, values, baseline, axis)  # noqa: E731
    if why is not None:
        notes.append(_not_drawn(why))
    written = _write_tables(root, rows, notes)
    if why is None:
        draw()
        written.append(path)
    return written


def _not_drawn(why: str) -> str:
    return f"summary.png not drawn: {why}; summary.csv holds every value"


def _write_tables(root: Path, rows: list[dict[str, Any]], notes: list[str]) -> list[Path]:
    written = [root / "summary.csv", root / "summary.md"]
    write_text(written[0], to_csv(rows), "summary.csv")
    markdown = to_markdown(rows, root)
    if notes:
        markdown += "\n" + "".join(f"Note: {note}.\n" for note in notes)
    write_text(written[1], markdown, "summary.md")
    return written


def _any_number(jobs: list[dict[str, Any]], name: str) -> bool:
    return any(_number(lookup(job["report"], f"metrics.surgered.{name}")) is not None for job in jobs)


def _first_report(jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((job["report"] for job in jobs if job["report"] is not None), None)


def metric_points(jobs: list[dict[str, Any]], metric: str) -> dict[str, float]:
    """{job: metric value} for the jobs whose report holds a number at ``metric``; an error if none does."""
    points = {}
    for job in jobs:
        value = _number(lookup(job["report"], metric))
        if value is not None:
            points[job["job"]] = value
    if points:
        return points
    present = [job["report"] for job in jobs if job["report"] is not None]
    if any(lookup(r, metric) is not None for r in present):
        raise SweepError(f"--metric {metric}: not a number in any report; choose a numeric field")
    known = sorted({p for r in present for p in _numeric_paths(r)})
    close = difflib.get_close_matches(metric, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    shown = [p for p in known if not p.startswith("timings.")]
    listed = ", ".join(shown[:20]) + (", ..." if len(shown) > 20 else "")
    raise SweepError(f"--metric {metric}: not in any report.{hint} Numeric fields: {listed or '(none)'}")


def choose_x(jobs: list[dict[str, Any]], x: str | None, points: dict[str, float]) -> dict[str, Any]:
    """The plot's x axis: ``--x``'s numeric values, the single varying override if numeric, else the job index.

    Returns ``label``, ``values`` {job: x}, ``ticks`` {job: tick label} (job-index plots) and
    ``series`` {job: legend label}: with ``--x``, jobs that differ in another override get their own line.
    """
    changing = varying(jobs)
    if x is not None:
        names = _override_names(jobs)
        name = x.lstrip("+")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SweepError(f"--x {x}: not an override of this sweep.{hint} Overrides: {', '.join(names) or '(none)'}")
        values = _numeric_values(jobs, name, points)
        if values is None:
            shown = sorted({str(job["overrides"].get(name)) for job in jobs})
            raise SweepError(
                f"--x {x}: cannot plot against non-numeric values ({', '.join(shown)}); leave --x out to plot"
                " against the job index"
            )
        others = [n for n in changing if n != name]
        return {"label": name, "values": values, "ticks": {}, "series": _labels(jobs, others)}
    if len(changing) == 1:
        values = _numeric_values(jobs, changing[0], points)
        if values is not None:
            return {"label": changing[0], "values": values, "ticks": {}, "series": {}}
    many = len(points) > 8  # many jobs: one slanted line each, else stacked lines
    labels = _labels(jobs, changing, ", " if many else "\n")
    ticks = {job: (f"{job}: " if many else f"{job}\n") + labels[job] if labels else job for job in points}
    return {"label": "job", "values": {j: float(i) for i, j in enumerate(points)}, "ticks": ticks, "series": {}}


def to_csv(rows: list[dict[str, Any]]) -> str:
    """The rows as CSV with a header line."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def to_markdown(rows: list[dict[str, Any]], root: Path) -> str:
    """The rows as a Markdown table under a title naming the sweep; floats to 4 significant digits."""
    header = list(rows[0])
    lines = [f"# Sweep {root}", "", f"{len(rows)} job(s).", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        lines.append("| " + " | ".join(_md_cell(row[h]) for h in header) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m surgery.app.sweep DIR [--metric PATH] [--x NAME]``; 0 on success, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m surgery.app.sweep",
        description="Collect a sweep's report.json files into DIR/summary.csv, summary.md and summary.png.",
    )
    parser.add_argument("dir", metavar="DIR", help="a sweep directory (hydra.sweep.dir) holding DIR/N/report.json")
    parser.add_argument(
        "--metric",
        default=None,
        help=f"dotted path into report.json to plot (default: every metric the reports hold, else {DEFAULT_METRIC})",
    )
    parser.add_argument("--x", default=None, help="override to plot against (default: the one that varies)")
    parser.add_argument("--no-plot", action="store_true", help="write summary.csv and summary.md only")
    args = parser.parse_args(argv)
    try:
        jobs = collect(args.dir)
        notes: list[str] = []
        written = write_collected(Path(args.dir), jobs, args.metric, args.x, not args.no_plot, notes)
    except (SweepError, RecursionError) as e:
        from surgery.app.hydra_messages import printable

        why = str(e) if isinstance(e, SweepError) else f"{args.dir}: a report nested too deeply to summarise"
        print(f"error: {printable(why)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    missing = [job["job"] for job in jobs if job["report"] is None]
    note = f" ({len(missing)} without a report: {', '.join(missing)})" if missing else ""
    print(f"collected {len(jobs)} job(s){note}; wrote {', '.join(str(p) for p in written)}")
    for line in notes:
        print(f"note: {line}")
    return 0


def _override_names(jobs: list[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for job in jobs:
        names.update(dict.fromkeys(job["overrides"]))
    return list(names)


def _numeric_values(jobs: list[dict[str, Any]], name: str, points: dict[str, float]) -> dict[str, float] | None:
    values = {}
    for job in jobs:
        if job["job"] in points:
            try:
                values[job["job"]] = float(job["overrides"].get(name, ""))
            except ValueError:
                return None
    return values


def _labels(jobs: list[dict[str, Any]], names: list[str], sep: str = ", ") -> dict[str, str]:
    """{job: "name=value, ..."} over ``names`` (short names where unambiguous); empty when no names."""
    if not names:
        return {}
    return {job["job"]: sep.join(f"{_short(n, names)}={job['overrides'].get(n, '')}" for n in names) for job in jobs}


def _short(name: str, names: list[str]) -> str:
    last = name.rsplit(".", 1)[-1]
    return last if sum(n.rsplit(".", 1)[-1] == last for n in names) == 1 else name


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _numeric_paths(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _numeric_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _status(report: dict[str, Any] | None) -> str:
    if report is None:
        return "no report"
    return "ok" if report.get("mode", "run") == "run" else str(report["mode"])


def _md_cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")


def _cell(value: Any) -> Any:
    return "" if value is None else value
