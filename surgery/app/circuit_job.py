"""``python -m surgery ... study.method=eap``: a circuit study (SPEC §21) as one job, written into the run directory.

Writes ``circuit.safetensors`` (``scores/M`` ``[edges]``, ``values/M`` ``[edges, examples]``), ``circuit.json``
(nodes, edges by |score|, faithfulness, verification), ``plots/circuit.png`` (the top edges),
``plots/faithfulness.png`` (with ``top_edges``), ``plots/circuit_verify.png`` (with ``verify_top``),
``report.json`` (its ``circuit`` section) and ``report.md``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from surgery.app.batches import input_spec, make_batches
from surgery.app.build import build_model, resolve_device, run_dtype, seed_everything, settings_of
from surgery.app.prepare import source_batches
from surgery.app.report import environment, fingerprint
from surgery.app.study_job import gathered_inputs
from surgery.circuit.config import CircuitConfig
from surgery.circuit.graph import build_graph
from surgery.circuit.result import CircuitResult
from surgery.circuit.run import check_circuit_method, run_circuit
from surgery.core.output import say
from surgery.core.schema import validate
from surgery.errors import ConfigError
from surgery.files.write import write_json, write_tensors, write_text
from surgery.report import circuit_markdown, write_report_html


def run_circuit_job(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Build the model, its inputs and the source, score every edge, write the circuit's files; returns report.json."""
    clock = time.perf_counter()
    settings = settings_of(cfg)
    study = validate(CircuitConfig, _plain(settings.study), "study")
    check_circuit_method(study.method, study.nodes, study.steps, study.top_edges, study.verify_top,
                         study.batch_cells)  # fmt: skip
    if settings.mode not in ("run", "plan"):
        raise ConfigError(
            f"mode: a circuit study runs with mode=run (or mode=plan to list its edges); got {settings.mode}"
        )
    if cfg.get("actions"):
        raise ConfigError("actions: a circuit study patches its edges itself and takes no actions; drop them")
    if cfg.get("source") is None:
        raise ConfigError("source: a circuit patches each edge towards a source run; give one (+source=text"
                          " source.prompt=...)")  # fmt: skip
    seed_everything(settings.seed)
    device = resolve_device(settings.device)
    model = build_model(cfg.model, settings, device)
    graph = build_graph(model, study.nodes)  # a family without a circuit graph is refused before any input is built
    report: dict[str, Any] = {"mode": "circuit" if settings.mode == "run" else "plan", "seed": settings.seed}
    if settings.mode == "plan":
        say(f"circuit: {len(graph.sender)} edges between {len(graph.senders)} senders and {len(graph.receivers)}"
            f" receivers ({graph.family}, nodes: {graph.nodes})")  # fmt: skip
        report.update(complete=True, circuit={"edges": len(graph.sender), "family": graph.family,
                                              "nodes": [n.name for n in graph.senders]})  # fmt: skip
        write_json(out_dir / "report.json", report)
        write_report_html(report, out_dir)
        return report
    spec = input_spec(_plain(cfg.model.get("input") or {}), _plain(cfg.get("input") or {}), model)
    data = make_batches(spec, settings.seed, run_dtype(settings, model), device, model, cfg.model.get("path"))
    source = source_batches(cfg, settings, device, model, data)
    assert source is not None
    if data.text is not None:
        from surgery.lm.kinds import STUDY_CAUSAL_ONLY, STUDY_INSTEAD, refuse_causal_metrics
        from surgery.study.metrics import parse_metrics

        refuse_causal_metrics(model, parse_metrics(study.metrics, data.tokenizer), "study.metrics", STUDY_CAUSAL_ONLY,
                              STUDY_INSTEAD)  # fmt: skip
    inputs, labels = gathered_inputs(data)
    src = gathered_inputs(source)[0]
    report["fingerprints"] = {"config": fingerprint(OmegaConf.to_container(cfg, resolve=True)),
                              "input": fingerprint(inputs)}  # fmt: skip
    loaded = time.perf_counter() - clock
    result = run_circuit(
        model, inputs, src, study.metrics, method=study.method, nodes=study.nodes, steps=study.steps,
        top_edges=study.top_edges, tokenizer=data.tokenizer, labels=labels, batch_size=study.batch_size,
        batch_edges=study.batch_cells, verify_top=study.verify_top,
    )  # fmt: skip
    seconds = {"load": loaded, **result.seconds}
    write_tensors(out_dir / "circuit.safetensors", result.tensors())
    result.to_json(out_dir / "circuit.json")
    plots = [result.plot(out_dir / "plots" / "circuit.png", study.plot_top)]
    if result.faithfulness:
        plots.append(result.plot_faithfulness(out_dir / "plots" / "faithfulness.png"))
    if result.verify:
        from surgery.circuit.plot import write
        from surgery.study.plots import verify_figure

        plots.append(out_dir / "plots" / "circuit_verify.png")
        write(plots[-1], verify_figure({**result.verify, "exact": result.verify["exact"]}))
    report.update(
        complete=True,
        circuit=_section(result, data.examples, seconds),
        model={"class": f"{type(model).__module__}.{type(model).__qualname__}"},
        data={"source": data.source, "examples": data.examples,
              **({"prompts": list(data.text.prompts)} if data.text is not None else {})},
        plots=[str(p.relative_to(out_dir)) for p in plots],
        environment=environment(str(device)),
    )  # fmt: skip
    write_json(out_dir / "report.json", report)
    write_text(out_dir / "report.md", circuit_markdown(report, result))
    write_report_html(report, out_dir)
    times = ", ".join(f"{part} {value:.2f} s" for part, value in seconds.items())
    say(f"circuit: {len(result.edges)} edges × {data.examples} examples ({result.method}, {times}); {headline(result)};"
        f" wrote {out_dir}")  # fmt: skip
    return report


def headline(result: CircuitResult, top: int = 3) -> str:
    """The edges with the largest |score|, e.g. ``head.0.1 -> attn.1 -4.2``."""
    edges = ", ".join(f"{e['sender']} -> {e['receiver']} {e['score']:.4g}" for e in result.ranked(top))
    return f"{result.metrics[0]} moved most by {edges}"


def _section(result: CircuitResult, examples: int, seconds: dict[str, float]) -> dict[str, Any]:
    """report.json's circuit section: the method, the counts, the top edges, faithfulness and the files."""
    return {
        "method": result.method, "nodes": result.graph.nodes, "family": result.graph.family,
        "edges": len(result.edges), "examples": examples, "metrics": result.metrics, "top": result.ranked(10),
        "baselines": {w: {m: float(v.mean()) for m, v in t.items()} for w, t in result.baselines.items()},
        "faithfulness": result.faithfulness, "verify": result.verify,
        "files": {"tensors": "circuit.safetensors", "json": "circuit.json"}, "seconds": seconds,
    }  # fmt: skip


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
