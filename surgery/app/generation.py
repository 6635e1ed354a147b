"""``mode=generate``: greedy continuation of a text input with the surgery and without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from surgery.core.engine import apply_plan
from surgery.core.records import flatten_captures
from surgery.errors import ConfigError
from surgery.files.write import write_json, write_tensors

GENERATE_KEYS = ("max_new_tokens", "do_sample")


def generate_options(given: Any) -> dict[str, Any]:
    """``generate`` run setting checked: ``max_new_tokens`` (default 20) and ``do_sample`` (default false)."""
    options = {"max_new_tokens": 20, "do_sample": False, **(dict(given) if given else {})}
    for key in options:
        if key not in GENERATE_KEYS:
            raise ConfigError(f"generate.{key}: unknown key; keys: {', '.join(GENERATE_KEYS)}")
    if not isinstance(options["do_sample"], bool):
        raise ConfigError(f"generate.do_sample: true or false, got {options['do_sample']!r}")
    return options


def generate_run(job: Any, out_dir: Path, report: dict[str, Any]) -> dict[str, Any]:
    """Generate under the surgery (after its source pass, if any) and without it; write the report."""
    from surgery.lm.generate import generate_both

    if job.data.text is None:
        raise ConfigError("mode: generate continues text; give a text input, e.g. +input=text input.prompt='...'")
    options = generate_options(job.settings.generate)
    common = {"tokenizer": job.data.tokenizer, "seed": job.settings.seed}
    new, sample = options["max_new_tokens"], options["do_sample"]
    if job.source is None:
        out = generate_both(job.model, job.plan, job.data.text, new, sample, **common)
    else:
        surgery = apply_plan(job.model, job.plan)
        try:
            with surgery.source_pass(), torch.no_grad():
                job.model(*job.source.first.args, **job.source.first.kwargs)
            out = generate_both(job.model, surgery, job.data.text, new, sample, **common)
        finally:
            surgery.remove()
    report["generate"] = out.to_dict()
    captures = flatten_captures(out.captures)
    if captures:
        write_tensors(out_dir / "captures.safetensors", captures)
    report["captures"] = {"file": "captures.safetensors" if captures else None, "count": len(captures), "shards": []}
    write_json(out_dir / "report.json", report)
    from surgery.report import write_report_html, write_report_md

    write_report_md(report, out_dir)
    write_report_html(report, out_dir, tokenizer=job.data.tokenizer)
    for row in report["generate"]["prompts"]:
        differ = row["first_difference"]
        print(f"prompt:     {row['prompt']!r}")
        print(f"unmodified: {row.get('unmodified', row['unmodified_tokens'])!r}")
        print(f"surgered:   {row.get('surgered', row['surgered_tokens'])!r}")
        print(f"            {'the same' if differ is None else f'first differs at new token {differ}'}")
    print(f"wrote {out_dir}")
    return report
