"""``report.md``: the run's ``report.json`` as a page for people, with the plots inline."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from surgery.files.write import write_text
from surgery.report.page import number

SHOWN_NAMES = 4  # matched names listed per plan row before "… (+N more)"
SHORT_HASH = 12
SHOWN_ACTIONS = 6  # in the title
SHOWN_CAPTURES = 32  # capture keys listed
SHOWN_VALUES = 8  # a captured tensor this small has its values listed
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def write_report_md(report: Mapping[str, Any], out_dir: Path, images: Iterable[Path] = ()) -> Path:
    """Write ``out_dir/report.md`` atomically from a run's report dict and plot paths; return its path.

    Every section is optional: a ``mode=plan`` report (mode, seed, plan, fingerprints) gives
    a page with the plan and fingerprints only.
    """
    path = out_dir / "report.md"
    text = render_report_md(report, out_dir, images)
    write_text(path, text, "report.md")
    return path


def render_report_md(report: Mapping[str, Any], out_dir: Path, images: Iterable[Path] = ()) -> str:
    """The markdown of ``report.md``; image links are relative to ``out_dir``."""
    sections = [
        _title(report),
        _metrics(report.get("metrics"), report.get("data")),
        _generation(report.get("generate")),
        _plan(report.get("plan") or []),
        _model(report.get("model")),
        _tensors(report),
        _difference(report.get("difference"), "original_output" in report or "difference" in report),
        _backward(report.get("backward")),
        _captures(report.get("captures"), out_dir),
        _lens(report.get("lens")),
        _images(images, out_dir),
        _key_values("Timings", {k.removesuffix("_s"): _seconds(v) for k, v in _dict(report, "timings")}),
        _key_values("Environment", dict(_dict(report, "environment"))),
        _key_values("Fingerprints (sha256, first 12 hex)", {k: _short(v) for k, v in _dict(report, "fingerprints")}),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def _metrics(metrics: Any, data: Any) -> str:
    """The metrics table first: each metric before and after the surgery and the change."""
    if not isinstance(metrics, Mapping) or not isinstance(metrics.get("surgered"), Mapping):
        return ""
    after, before, delta = metrics["surgered"], metrics.get("unmodified", {}), metrics.get("delta", {})
    source = f" on {data.get('source')}, {data.get('examples')} examples" if isinstance(data, Mapping) else ""
    lines = [f"## Metrics{source}", "", "| metric | unmodified | surgered | change |", "|---|---:|---:|---:|"]
    for name, value in after.items():
        cells = [_metric_cell(before.get(name)), _metric_cell(value), _metric_cell(delta.get(name), True)]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _generation(generate: Any) -> str:
    """Both continuations of each prompt and where they first differ (mode=generate)."""
    if not isinstance(generate, Mapping):
        return ""
    lines = ["## Generation", "", "| prompt | unmodified | surgered | first difference |", "|---|---|---|---|"]
    for row in generate.get("prompts", []):
        texts = [row.get(k, row.get(f"{k}_tokens")) for k in ("unmodified", "surgered")]
        differ = row.get("first_difference")
        cells = [
            _escape(row.get("prompt")),
            *(_escape(t) for t in texts),
            "none" if differ is None else f"token {differ}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _lens(lens: Any) -> str:
    """``lens: logit`` captures with ``top``: per block (rows) and position (columns), the top tokens of example 0."""
    if not lens:
        return ""
    parts = []
    for action, found in lens.items():
        rows = found.get("tokens") or {}
        if not rows:
            continue
        width = max(len(v) for v in rows.values())
        table = [["module", *(f"pos {i}" for i in range(width))]]
        table += [[_code(module), *(" · ".join(repr(t)[1:-1] for t in pos) for pos in positions)]
                  for module, positions in rows.items()]  # fmt: skip
        title = f"### {_escape(action)}: top {found.get('top')} tokens per position (example 0)"
        parts.append(f"{title}\n\n{_table(table)}")
    return "## Logit lens\n\n" + "\n\n".join(parts) if parts else ""


def _metric_cell(value: Any, signed: bool = False) -> str:
    if not isinstance(value, (int, float)):
        return "–"
    return f"{value:+.4g}" if signed else f"{value:.4g}"


def _title(report: Mapping[str, Any]) -> str:
    model = report.get("model") or {}
    name = str(model.get("class", "")).rsplit(".", 1)[-1] if isinstance(model, Mapping) else ""
    actions = [str(step.get("action")) for step in report.get("plan") or [] if isinstance(step, Mapping)]
    mode = report.get("mode", "run")
    heading = f"# surgery {mode}" + (f": {name}" if name else "")
    listed = ", ".join(actions[:SHOWN_ACTIONS]) + (
        f", … (+{len(actions) - SHOWN_ACTIONS} more)" if len(actions) > SHOWN_ACTIONS else ""
    )
    heading += f" — {listed}" if actions else " — no actions"
    facts = [f"mode `{mode}`"]
    if "seed" in report:
        facts.append(f"seed `{report['seed']}`")
    if report.get("batches") not in (None, 1):
        facts.append(f"{report['batches']} batches")
    device = (report.get("environment") or {}).get("device")
    if device:
        facts.append(f"device `{device}`")
    if report.get("complete") is False:
        facts.append(
            f"**incomplete**: stopped after {report.get('batches_done', '?')} of {report.get('batches', '?')} batches"
        )
    if "restored" in report:
        facts.append("model restored exactly: **" + ("yes" if report["restored"] else "no") + "**")
    return heading + "\n\n" + " · ".join(facts)


def _plan(plan: list[Any]) -> str:
    if not plan:
        return "## Plan\n\nNo actions."
    rows = [["action", "kind", "mechanism", "hooks", "matched"]]
    for step in plan:
        if not isinstance(step, Mapping):
            continue
        names = step.get("tensors") or step.get("matched") or []
        matched = f"{len(names)}: {_names(names)}" if names else "-"
        mechanism = str(step.get("mechanism", "")) if step.get("enabled", True) else "(disabled)"
        hooks = step.get("hooks", "-")
        rows.append([_code(step.get("action", "?")), str(step.get("kind", "")), mechanism, str(hooks), matched])
    return "## Plan\n\n" + _table(rows)


def _names(names: list[Any]) -> str:
    shown = ", ".join(_code(n) for n in names[:SHOWN_NAMES])
    return shown + (f", … (+{len(names) - SHOWN_NAMES} more)" if len(names) > SHOWN_NAMES else "")


def _model(model: Any) -> str:
    if not isinstance(model, Mapping):
        return ""
    rows = [["", "before", "after"]]
    for what in ("modules", "parameters"):
        before, after = model.get(f"{what}_before"), model.get(f"{what}_after")
        if before is not None or after is not None:
            rows.append([what, _number(before), _number(after)])
    text = f"## Model\n\n{_code(model.get('class', '?'))}"
    return text + ("\n\n" + _table(rows) if len(rows) > 1 else "")


def _tensors(report: Mapping[str, Any]) -> str:
    rows = [["tensor", "shape", "dtype", "mean", "std", "min", "max"]]
    inputs = report.get("input") or []
    for i, s in enumerate(inputs if isinstance(inputs, list) else [inputs]):
        rows.append(_stat_row(f"input {i}" if len(inputs) > 1 else "input", s))
    for key, label in (("output", "output"), ("original_output", "unmodified output")):
        if report.get(key) is not None:
            rows.append(_stat_row(label, report[key]))
    return "## Input and output\n\n" + _table(rows) if len(rows) > 1 else ""


def _stat_row(label: str, s: Any) -> list[str]:
    if not isinstance(s, Mapping):
        return [label, "-", "-", "-", "-", "-", "-"]
    shape = s.get("shape")
    cells = [label, _code(shape) if shape is not None else str(s.get("type", "-")), str(s.get("dtype", "-"))]
    return cells + [_number(s.get(k)) for k in ("mean", "std", "min", "max")]


def _difference(diff: Any, compared: bool) -> str:
    if not compared:
        return ""
    title = "## Difference to the unmodified model\n\n"
    if not isinstance(diff, Mapping):
        return title + "Not compared (`compare=false`)."
    if not diff.get("comparable", True):
        return title + f"Not comparable: {diff.get('reason', 'unknown reason')}."
    rows = [["max abs", "mean abs", "MSE", "KL(original ‖ surgered)", "identical"]]
    equal = diff.get("equal")
    rows.append(
        [_number(diff.get(k)) for k in ("max_abs", "mean_abs", "mse", "kl")]
        + ["-" if equal is None else ("yes" if equal else "no")]
    )
    return title + _table(rows)


def _captures(captures: Any, out_dir: Path) -> str:
    if not isinstance(captures, Mapping):
        return ""
    count, file, shards = captures.get("count", 0), captures.get("file"), captures.get("shards") or []
    lines = [f"{count} captured tensor(s)" + (f" in `{file}`" if file else "") + "."]
    if shards:
        lines.append(f"{len(shards)} shard(s) streamed to disk under `captures/`: {_names(shards)}.")
    text = "## Captures\n\n" + " ".join(lines)
    if file and (out_dir / str(file)).is_file():
        text += "\n\n" + _capture_table(out_dir / str(file))
    return text


def _capture_table(path: Path) -> str:
    """Key, shape and (for tensors of a few elements) the values, read lazily from a safetensors file."""
    from surgery.files.libraries import safetensors_reader

    rows = [["key", "shape", "dtype", "values"]]
    with safetensors_reader(path, "report.md") as f:
        keys = list(f.keys())
        for key in keys[:SHOWN_CAPTURES]:
            part = f.get_slice(key)
            shape, dtype = part.get_shape(), part.get_dtype()
            values = "(empty)" if math.prod(shape) == 0 else ""
            if 0 < math.prod(shape) <= SHOWN_VALUES:
                values = ", ".join(f"{v:.4g}" for v in f.get_tensor(key).double().flatten().tolist())
            elif not values:  # too many to list: what they look like
                values = _summary(f.get_tensor(key))
            rows.append([_code(key), _code(list(shape)), DTYPES.get(dtype, dtype), values])
    more = f"\n\n… and {len(keys) - SHOWN_CAPTURES} more keys." if len(keys) > SHOWN_CAPTURES else ""
    return _table(rows) + more


def _summary(tensor: Any) -> str:
    """Mean, std, min and max of a captured tensor's finite values, for a table cell."""
    values = tensor.double().flatten()
    finite = values[values.isfinite()]
    if finite.numel() == 0:
        return "no finite values"
    std = finite.std().item() if finite.numel() > 1 else 0.0
    low, high = finite.min().item(), finite.max().item()
    text = f"mean {finite.mean().item():.4g}, std {std:.4g}, min {low:.4g}, max {high:.4g}"
    return text + (f" ({values.numel() - finite.numel()} non-finite)" if finite.numel() < values.numel() else "")


def _backward(record: Any) -> str:
    """The backward pass a ``backward=true`` run made: which loss, and its value on batch 0."""
    if not isinstance(record, Mapping):
        return ""
    lines = ["## Backward pass", "", f"- loss: {record.get('loss')}"]
    for key, label in (("value", "surgered, batch 0"), ("original", "unmodified, batch 0"), ("mean", "surgered, mean")):
        if record.get(key) is not None:
            lines.append(f"- {label}: {record[key]:.6g}")
    return "\n".join(lines)


def _images(images: Iterable[Path], out_dir: Path) -> str:
    links = []
    for image in images:
        image = Path(image)
        rel = Path(os.path.relpath(image, out_dir)) if image.is_absolute() else image
        title = image.stem.replace("__", " · ")
        links.append(f"![{_escape(title)}]({rel.as_posix().replace(' ', '%20')})")
    return "## Plots\n\n" + "\n\n".join(links) if links else ""


def _key_values(title: str, values: Mapping[str, Any]) -> str:
    if not values:
        return ""
    return f"## {title}\n\n" + "\n".join(f"- {k}: {_cell(v)}" for k, v in values.items())


def _dict(report: Mapping[str, Any], key: str) -> Iterable[tuple[str, Any]]:
    value = report.get(key)
    return value.items() if isinstance(value, Mapping) else ()


def _table(rows: list[list[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(_escape(c) for c in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_escape(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _escape(text: str) -> str:
    """Keep a cell in its table: escape pipes, flatten newlines."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    """Inline code, so names such as ``<root>`` or ``a_b_c`` are not read as HTML or emphasis."""
    text = str(value).replace("`", "'")
    return f"`{text}`"


def _cell(value: Any) -> str:
    return _number(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _number(value: Any) -> str:
    return number(value, missing="-")


def _seconds(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.3g} s" if value >= 1 else f"{value * 1000:.3g} ms"


def _short(value: Any) -> str:
    return f"`{str(value)[:SHORT_HASH]}`" if value else "-"
