"""The sections every kind of run shares in ``report.html``: title, plan, metrics, generation, tensors, plots, facts.

Each function takes part of ``report.json``'s dict and returns escaped HTML ('' when the run has no such part).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from surgery.errors import ConfigError
from surgery.files.gate import member, read_bytes
from surgery.report.page import data_uri, escape, mapping, number, plain, table

SHOWN_NAMES = 8  # matched names listed per plan row; the rest behind "more"
IMAGE_MAX = 4 * 2**20  # one plot inlined at most this big; a larger one is named, not inlined
IMAGES_MAX = 12 * 2**20  # every inlined plot together


def header(report: Mapping[str, Any]) -> tuple[str, str]:
    """The page's title and its header: mode, model, actions, and the run's headline facts."""
    model = mapping(report.get("model"))
    name = str(model.get("class", "")).rsplit(".", 1)[-1]
    mode = str(report.get("mode", "run"))
    plan = _plan_of(report)
    actions = ", ".join(str(step.get("action")) for step in plan[:6]) + (" …" if len(plan) > 6 else "")
    title = f"surgery {mode}" + (f": {name}" if name else "") + (f" — {actions}" if actions else "")
    facts = [f"mode {mode}"]
    if "seed" in report:
        facts.append(f"seed {report['seed']}")
    device = mapping(report.get("environment")).get("device")
    if device:
        facts.append(f"device {device}")
    if report.get("complete") is False:
        facts.append(f"incomplete: {report.get('batches_done', '?')} of {report.get('batches', '?')} batches")
    if "restored" in report:
        facts.append("model restored exactly: " + ("yes" if report["restored"] else "NO"))
    items = "".join(f"<li>{escape(f)}</li>" for f in facts)
    return title, f'<h1>{escape(title)}</h1><ul class="facts">{items}</ul>'


def _plan_of(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    plan = report.get("plan")
    if not plan and isinstance(report.get("study"), Mapping):  # a study in mode=plan: its first cell's plan
        plan = report["study"].get("first")
    return [step for step in plan if isinstance(step, Mapping)] if isinstance(plan, list) else []


def plan_table(report: Mapping[str, Any]) -> str:
    """Every action: kind, mechanism, hooks and the names it matched (the first few, the rest behind "more")."""
    rows = []
    for step in _plan_of(report):
        names = [str(n) for n in step.get("tensors") or step.get("matched") or []]
        shown = ", ".join(names[:SHOWN_NAMES])
        more = names[SHOWN_NAMES:]
        matched = escape(f"{len(names)}: {shown}") if names else "–"
        if more:
            matched += f"<details><summary>{len(more)} more</summary>{escape(', '.join(more))}</details>"
        mechanism = str(step.get("mechanism", "")) if step.get("enabled", True) else "(disabled)"
        cells = [step.get("action", "?"), step.get("kind", ""), mechanism, step.get("hooks", "–")]
        rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + f"<td>{matched}</td></tr>")
    if not rows:
        return "<p>No actions.</p>" if "plan" in report else ""
    head = "".join(f"<th>{h}</th>" for h in ("action", "kind", "mechanism", "hooks", "matched"))
    warnings = "".join(f'<p class="warn">{escape(w)}</p>' for w in report.get("warnings") or [])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{warnings}"


def recipe(actions: Mapping[str, Any] | None) -> str:
    """A study's actions as configured (placeholders such as ``{layer}`` unfilled): one row per action."""
    if not actions:
        return ""
    rows = []
    for name, spec in actions.items():
        spec = mapping(spec)
        rest = "; ".join(f"{k}: {json.dumps(plain(v), ensure_ascii=False)}" for k, v in spec.items() if k != "kind")
        rows.append([name, spec.get("kind", ""), rest])
    return "<p>The actions every cell fills in with its grid values:</p>" + table(["action", "kind", "settings"], rows)


def metrics(report: Mapping[str, Any]) -> str:
    """Each metric before and after the surgery and the change; then the splice metrics per site."""
    parts = []
    found = report.get("metrics")
    if isinstance(found, Mapping) and isinstance(found.get("surgered"), Mapping):
        before, delta = found.get("unmodified") or {}, found.get("delta") or {}
        rows = [[name, number(before.get(name)), number(value), _signed(delta.get(name))]
                for name, value in found["surgered"].items()]  # fmt: skip
        data = report.get("data") if isinstance(report.get("data"), Mapping) else {}
        on = f"on {data.get('source')}, {data.get('examples')} examples" if data else ""
        parts.append((f"<p>{escape(on)}</p>" if on else "") + table(["metric", "unmodified", "surgered", "change"],
                                                                    rows, {1, 2, 3}))  # fmt: skip
    splice = report.get("splice_metrics")
    if isinstance(splice, Mapping):
        per_site = {k: v for k, v in splice.items() if isinstance(v, Mapping)}
        sites = sorted({site for values in per_site.values() for site in values})
        rows = [[site, *(number(per_site[m].get(site)) for m in per_site)] for site in sites]
        rows += [[name, number(value)] + [""] * (len(per_site) - 1)
                 for name, value in splice.items() if not isinstance(value, Mapping)]  # fmt: skip
        parts.append("<h3>Splice metrics</h3>" + table(["splice", *per_site], rows, set(range(1, len(per_site) + 1))))
    return "\n".join(parts)


def _signed(value: Any) -> str:
    return f"{value:+.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "–"


def generation(report: Mapping[str, Any], decode: Callable[[int], str] | None = None) -> str:
    """mode=generate: each prompt, then the unmodified and surgered continuations side by side; with ``decode``
    (a token id's text) the tokens from the first difference on are marked."""
    found = report.get("generate")
    if not isinstance(found, Mapping):
        return ""
    blocks = []
    for row in found.get("prompts") or []:
        if not isinstance(row, Mapping):
            continue
        differ = row.get("first_difference")
        sides = "".join(
            f'<div class="side"><h3>{label}</h3>{_continuation(row, key, differ, decode)}</div>'
            for key, label in (("unmodified", "unmodified"), ("surgered", "surgered"))
        )
        where = "the same" if differ is None else f"first differs at new token {differ}"
        blocks.append(f'<div class="prompt"><p><b>prompt</b> <code>{escape(row.get("prompt"))}</code>'
                      f' — {escape(where)}</p><div class="sides">{sides}</div></div>')  # fmt: skip
    return "\n".join(blocks)


def _continuation(row: Mapping[str, Any], key: str, differ: Any, decode: Callable[[int], str] | None) -> str:
    """A continuation as text; decoded token by token, those from the first difference on are marked."""
    ids = row.get(f"{key}_tokens")
    if decode is not None and isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        pieces = [decode(t) for t in ids]
        at = len(pieces) if differ is None else int(differ)
        same, changed = pieces[:at], pieces[at:]
        return f'<pre class="text">{escape("".join(same))}<mark>{escape("".join(changed))}</mark></pre>'
    text = row.get(key, row.get(f"{key}_tokens"))
    return f'<pre class="text">{escape(text)}</pre>'


def tensors(report: Mapping[str, Any]) -> str:
    """The model's module and parameter counts, the input and output statistics, the difference to the unmodified."""
    parts = []
    model = report.get("model")
    if isinstance(model, Mapping) and "modules_before" in model:
        rows = [[what, number(model.get(f"{what}_before")), number(model.get(f"{what}_after"))]
                for what in ("modules", "parameters")]  # fmt: skip
        parts.append(f"<p><code>{escape(model.get('class', '?'))}</code></p>" + table(["", "before", "after"], rows,
                                                                                      {1, 2}))  # fmt: skip
    inputs = report.get("input")
    inputs = inputs if isinstance(inputs, list) else [inputs] if inputs else []
    named = [(f"input {i}" if len(inputs) > 1 else "input", s) for i, s in enumerate(inputs)]
    named += [(label, report[key]) for key, label in (("output", "output"), ("original_output", "unmodified output"))
              if isinstance(report.get(key), Mapping)]  # fmt: skip
    rows = [[label, s.get("shape", s.get("type", "–")), s.get("dtype", "–"),
             *(number(s.get(k)) for k in ("mean", "std", "min", "max"))]
            for label, s in named if isinstance(s, Mapping)]  # fmt: skip
    parts.append(table(["tensor", "shape", "dtype", "mean", "std", "min", "max"], rows, {3, 4, 5, 6}))
    diff = report.get("difference")
    if isinstance(diff, Mapping):
        if diff.get("comparable", True):
            cells = [number(diff.get(k)) for k in ("max_abs", "mean_abs", "mse", "kl")] + [number(diff.get("equal"))]
            parts.append("<h3>Difference to the unmodified model</h3>"
                         + table(["max abs", "mean abs", "MSE", "KL(original ‖ surgered)", "identical"], [cells],
                                 {0, 1, 2, 3}))  # fmt: skip
        else:
            parts.append(f"<p>Not comparable: {escape(diff.get('reason', 'unknown reason'))}.</p>")
    captures = report.get("captures")
    if isinstance(captures, Mapping) and captures.get("count"):
        where = f" in {captures.get('file')}" if captures.get("file") else ""
        parts.append(f"<p>{escape(captures.get('count'))} captured tensor(s){escape(where)}.</p>")
    return "\n".join(p for p in parts if p)


def plots(names: Iterable[str], out_dir: Path, skip: Iterable[str] = ()) -> str:
    """The run's PNG plots inline (``data:`` URIs), each titled by its file name; one too large is only named."""
    figures, total, left = [], 0, set(skip)
    for name in names:
        if name in left or not str(name).endswith(".png"):
            continue
        try:
            data = read_bytes(member(out_dir, str(name), "report.html", "a plot"), "report.html", IMAGE_MAX, "a plot")
        except ConfigError as e:  # too large, missing or not a plain name: say so in place of the picture
            figures.append(f"<figure><figcaption>{escape(name)}: not inlined ({escape(e)})</figcaption></figure>")
            continue
        if total + len(data) > IMAGES_MAX:
            figures.append(f"<figure><figcaption>{escape(name)}: not inlined (the page's plots are"
                           f" {IMAGES_MAX // 2**20} MiB already)</figcaption></figure>")  # fmt: skip
            continue
        total += len(data)
        figures.append(f'<figure><img alt="{escape(name)}" src="{data_uri(data, "image/png")}">'
                       f"<figcaption>{escape(name)}</figcaption></figure>")  # fmt: skip
    return "\n".join(figures)


def facts(report: Mapping[str, Any]) -> str:
    """Timings, environment, fingerprints (first 12 hex) and, for a harvest, what it wrote."""
    parts = []
    for key, title in (("harvest", "Harvest"), ("timings", "Timings"), ("environment", "Environment"),
                       ("fingerprints", "Fingerprints (sha256)")):  # fmt: skip
        values = report.get(key)
        if not isinstance(values, Mapping) or not values:
            continue
        short = key == "fingerprints"
        rows = [[k, (str(v)[:12] if short and v else _value(v))] for k, v in values.items()]
        parts.append(f"<h3>{escape(title)}</h3>" + table(["", ""], rows))
    return "\n".join(parts)


def _value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {v}" for k, v in value.items())
    return number(value)
