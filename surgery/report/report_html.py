"""``report.html``: one self-contained page per run, from the run's report dict, its files and what is in memory.

What each kind of run shows: the plan and metrics (every run); the two continuations side by side
(``mode=generate``); the interactive heatmap per metric, the baselines and the ``verify_top`` scatter (a study);
the graph and faithfulness curve (a run directory holding ``circuit.json``); the top features and their tokens
(a splice with ``capture: true``); the plots, inline. Nothing in the page is fetched: see :mod:`surgery.report.page`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from surgery.files.write import write_text
from surgery.report import sections
from surgery.report.circuit import circuit_html, read_circuit
from surgery.report.page import Section, mapping, page
from surgery.report.splice import splice_html
from surgery.report.study import study_data, study_html, verify_html

TOKENS_MAX = 64  # examples whose tokens label a splice's features


def write_report_html(report: Mapping[str, Any], out_dir: Path, **options: Any) -> Path:
    """Write ``out_dir/report.html`` atomically (``options`` as :func:`render_report_html` takes them); its path."""
    path = Path(out_dir) / "report.html"
    write_text(path, render_report_html(report, Path(out_dir), **options), "report.html")
    return path


def render_report_html(
    report: Mapping[str, Any],
    out_dir: Path,
    *,
    tokenizer: Any = None,
    input_ids: Any = None,
    captures: Mapping[str, Any] | None = None,
    actions: Mapping[str, Any] | None = None,
) -> str:
    """The page of a run: ``report`` is report.json's dict; ``out_dir`` holds the files it names (plots,
    study.safetensors, circuit.json); ``tokenizer`` and ``input_ids`` label tokens; ``captures`` (flat, in
    memory) give a splice's features; ``actions`` (a study's recipe) is shown as configured."""
    title, header = sections.header(report)
    study = report.get("study") if isinstance(report.get("study"), Mapping) else None
    heatmap = study_data(study, out_dir) if study is not None else None
    circuit = read_circuit(out_dir)
    decode = _decoder(tokenizer)
    parts: list[Section] = [
        ("plan", "Plan", sections.plan_table(report) or sections.recipe(actions)),
        ("metrics", "Metrics", sections.metrics(report)),
        ("generation", "Generation", sections.generation(report, decode)),
        ("study", "Study", study_html(study, heatmap) if study is not None else ""),
        ("verify", "Verify: estimated against exact", verify_html(mapping(study).get("verify"))),
        ("circuit", "Circuit", circuit_html(circuit) if circuit is not None else ""),
        ("splice", "Splice features", splice_html(captures, _tokens(input_ids, decode))),
        ("tensors", "Model, input and output", sections.tensors(report)),
        ("plots", "Plots", sections.plots(_plots(report, study is not None), out_dir)),
        ("facts", "Run facts", sections.facts(report)),
    ]
    return page(title, header, parts, {"study": heatmap})


def _plots(report: Mapping[str, Any], study: bool) -> list[str]:
    """The run's PNGs to inline; a study's heatmaps and scatter are drawn by the page itself."""
    names = [str(p) for p in report.get("plots") or []]
    return [n for n in names if not (study and Path(n).name.startswith("study_"))]


def _decoder(tokenizer: Any) -> Any:
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        return None
    return lambda token: str(tokenizer.decode([int(token)]))


def _tokens(input_ids: Any, decode: Any) -> list[list[str]] | None:
    """The first examples' tokens as text, to label where a feature fired."""
    if input_ids is None or decode is None or getattr(input_ids, "dim", lambda: 0)() != 2:
        return None
    return [[decode(t) for t in row.tolist()] for row in input_ids[:TOKENS_MAX]]
