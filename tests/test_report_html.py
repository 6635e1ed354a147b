"""report.html in a real headless browser (Chromium through Playwright; scripts/setup installs both): the page
loads with no console error and no request but its own file, hovering a study cell shows that cell's numbers
as study.safetensors holds them, clicking lists its examples, and hostile strings stay text (SPEC §22)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from surgery.app.job import run_job
from surgery.report import render_report_html, write_report_html
from tests.test_cli import composed

CLEAN = ["w3 w17 w42 w8 w3 w17", "w5 w9 w11 w2 w5 w9", "w1 w2 w3 w4 w1 w2"]
CORRUPT = ["w3 w17 w42 w8 w3 w20", "w5 w9 w11 w2 w5 w30", "w1 w2 w3 w4 w1 w40"]
HOSTILE = "</script><script>alert(1)</script>"


def chromium() -> str:
    """The Chromium scripts/setup installs (apt's /usr/bin/chromium), or $CHROMIUM."""
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "no Chromium: run scripts/setup (it installs the chromium package) or set CHROMIUM=/path/to/it"
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright  # scripts/setup installs it (the dev extra)

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        yield launched
        launched.close()


class Opened:
    """A page opened from a file, with every console error, page error, dialog and request it caused."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.dialogs: list[str] = []
        self.page = browser.new_page(viewport={"width": 1200, "height": 900})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)

    def assert_clean(self) -> None:
        """No console error, no script error, no dialog, no request but the page itself (and inline data: URIs)."""
        assert self.errors == [] and self.dialogs == []
        assert [u for u in self.requests if u != self.url and not u.startswith("data:")] == []


def g4(value: float) -> str:
    """What the page shows for a number: Python's %.4g of the float32 the file holds."""
    return f"{float(value):.4g}"


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("study")
    prompts = lambda key, texts: f"{key}.prompts=[{','.join(texts)}]"  # noqa: E731
    run_job(composed("+model=induction_lm", "+input=text", prompts("input", CORRUPT), "+source=text",
                     prompts("source", CLEAN), "+study=patch_layer_pos", "study.metrics=[kl, {prob: {token: w17}}]",
                     "+study.n_boot=200"), out)  # fmt: skip
    return out


def test_hovering_a_study_cell_shows_its_numbers_and_clicking_lists_its_examples(browser: Any, study_dir: Path) -> None:
    saved = load_file(study_dir / "study.safetensors")
    report = json.loads((study_dir / "report.json").read_text())
    assert list(report["study"]["grid"]) == ["layer", "pos"] and report["study"]["examples"] == 3
    layer, pos = 1, 6  # the last token, where the prompts differ: patching the clean run there moves the prediction
    index = layer * len(report["study"]["grid"]["pos"]) + pos
    opened = Opened(browser, study_dir / "report.html")
    for metric, name in enumerate(("kl", "prob")):
        opened.page.hover(f'.heatmap[data-metric="{metric}"] rect[data-cell="{index}"]')
        tip = opened.page.text_content("#tip")
        mean, low, high = (saved[f"{part}/{name}"][layer, pos] for part in ("mean", "ci_low", "ci_high"))
        assert f'layer = 1, pos = 6 "{report["study"]["tokens"][pos]}"' in tip
        assert f"{name} mean {g4(mean)}" in tip and f"95% CI [{g4(low)}, {g4(high)}]" in tip
        assert low < high  # a real interval: three different examples
        opened.page.click(f'.heatmap[data-metric="{metric}"] rect[data-cell="{index}"]')
        rows = opened.page.locator("#detail table.examples tr").all_inner_texts()
        values = saved[f"values/{name}"][layer, pos]
        assert [re.split(r"\s+", r.strip()) for r in rows[1:]] == [[str(e), g4(v)] for e, v in enumerate(values)]
    assert opened.page.is_hidden("#tip") is False
    opened.page.mouse.move(1, 1)
    assert opened.page.locator("#tip").is_hidden()
    assert "study_cap" in opened.page.text_content("#plan")  # the recipe every cell fills in
    opened.assert_clean()


def test_the_page_draws_one_cell_per_grid_value_and_embeds_no_study_png(browser: Any, study_dir: Path) -> None:
    text = (study_dir / "report.html").read_text()
    opened = Opened(browser, study_dir / "report.html")
    assert opened.page.locator('.heatmap[data-metric="0"] rect[data-cell]').count() == 2 * 7
    assert "data:image/png" not in text  # the heatmaps are drawn by the page; study_*.png stay files
    assert len(text) < 100_000
    opened.assert_clean()


def test_an_attribution_study_shows_its_verify_scatter(browser: Any, tmp_path: Path) -> None:
    prompts = lambda key, texts: f"{key}.prompts=[{','.join(texts)}]"  # noqa: E731
    report = run_job(composed("+model=induction_lm", "+input=text", prompts("input", CORRUPT), "+source=text",
                              prompts("source", CLEAN), "+study=patch_layer_pos", "study.metrics=[kl]", "study.ci=null",
                              "+study.method=attribution", "+study.verify_top=4"), tmp_path)  # fmt: skip
    verify = report["study"]["verify"]
    opened = Opened(browser, tmp_path / "report.html")
    dots = opened.page.locator("#verify circle.dot")
    assert dots.count() == 4
    tips = dots.all_text_contents()
    for cell, exact, guess in zip(verify["cells"], verify["exact"], verify["estimate"]):
        where = " ".join(f"{k}={v}" for k, v in cell.items())
        assert f"{where}: exact {exact:.4g}, estimated {guess:.4g}" in tips
    assert f"Pearson {verify['pearson']:.4g}" in opened.page.text_content("#verify svg text.title")
    opened.page.hover('.heatmap rect[data-cell="0"]')
    assert "CI" not in opened.page.text_content("#tip")  # ci: null, no interval to show
    opened.assert_clean()


def test_a_plain_run_page_has_the_plan_metrics_and_its_plots_inline(browser: Any, tmp_path: Path) -> None:
    capture = "+actions.c={kind: capture, select: '@attn_pattern.1', plot: true}"
    report = run_job(composed("+model=induction_lm", "+actions=scale_attention", capture), tmp_path)
    opened = Opened(browser, tmp_path / "report.html")
    plan = opened.page.text_content("#plan")
    assert "scale_attention" in plan and "model.layers.0.self_attn, model.layers.1.self_attn" in plan
    metrics = opened.page.locator("#metrics tr").all_inner_texts()
    found = report["metrics"]
    want = [g4(found[k]["perplexity"]) for k in ("unmodified", "surgered")] + [f"{found['delta']['perplexity']:+.4g}"]
    assert ["perplexity", *want] in [row.split("\t") for row in metrics]
    widths = opened.page.eval_on_selector_all("#plots img", "images => images.map(i => i.naturalWidth)")
    assert len(widths) == len(report["plots"]) == 1 and min(widths) > 100  # decoded from its data: URI
    opened.assert_clean()


def hostile_run(out: Path, cells: tuple[int, int] = (2, 3), examples: int = 2) -> dict[str, Any]:
    """A run directory made by hand: a study whose token, action, metric and module names are all hostile."""
    layers, positions = cells
    g = torch.Generator().manual_seed(0)
    values = torch.randn(layers, positions, examples, generator=g)
    name = f"m{HOSTILE}"
    save_file({f"values/{name}": values, f"mean/{name}": values.mean(-1), f"ci_low/{name}": values.amin(-1),
               f"ci_high/{name}": values.amax(-1)}, str(out / "study.safetensors"))  # fmt: skip
    tokens = [f"t{i}" for i in range(positions)]
    tokens[1] = HOSTILE
    return {
        "mode": "study", "seed": 0,
        "model": {"class": f"x.{HOSTILE}"},
        "study": {"grid": {"layer": list(range(layers)), "pos": list(range(positions))}, "cells": layers * positions,
                  "examples": examples, "metrics": [name], "mean": {}, "ci": 0.95, "tokens": tokens,
                  "baselines": {"unmodified": {name: 0.5}}, "normalized": None},
        "environment": {"device": HOSTILE},
    }  # fmt: skip


def test_hostile_strings_stay_text(browser: Any, tmp_path: Path) -> None:
    report = hostile_run(tmp_path)
    actions = {HOSTILE: {"kind": "capture", "select": f"@resid_pre.{{layer}}{HOSTILE}"}}
    write_report_html(report, tmp_path, actions=actions)
    text = (tmp_path / "report.html").read_text()
    assert "<script>alert" not in text and text.count("<script") == 2
    opened = Opened(browser, tmp_path / "report.html")
    assert opened.page.eval_on_selector_all("script", "s => s.length") == 2
    assert HOSTILE in opened.page.title() and HOSTILE in opened.page.text_content("#plan")
    opened.page.hover('rect[data-cell="1"]')  # layer 0, position 1: the hostile token
    assert f'pos = 1 "{HOSTILE}"' in opened.page.text_content("#tip")
    opened.page.click('rect[data-cell="1"]')
    assert f"m{HOSTILE} at layer = 0" in opened.page.text_content("#detail h3")
    opened.assert_clean()  # no alert: no dialog


def test_a_thousand_cell_study_page_stays_small(browser: Any, tmp_path: Path) -> None:
    report = hostile_run(tmp_path, cells=(10, 100), examples=64)
    report["study"]["metrics"] = names = [f"m{HOSTILE}"]
    text = render_report_html(report, tmp_path)
    assert len(text.encode()) < 2 * 2**20
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', text).group(1))["study"]
    assert data["shown"] == 64 and len(data["metrics"][0]["values"]) == 1000 * 64
    saved = load_file(tmp_path / "study.safetensors")
    assert torch.equal(torch.tensor(data["metrics"][0]["mean"]).float(), saved[f"mean/{names[0]}"].reshape(-1))
    # past the budget the page keeps the first examples of every cell, and says so
    more = hostile_run(tmp_path, cells=(10, 100), examples=1000)
    big = render_report_html(more, tmp_path)
    assert len(big.encode()) < 2 * 2**20 and "The page holds the first 100 of 1000 examples" in big
    (tmp_path / "report.html").write_text(big)
    opened = Opened(browser, tmp_path / "report.html")
    assert opened.page.locator("rect[data-cell]").count() == 1000
    opened.page.click('rect[data-cell="999"]')
    assert opened.page.locator("#detail table.examples tr").count() == 1 + 100
    opened.assert_clean()


@pytest.mark.parametrize("grid", [{"head": 3, "layer": 2, "pos": 4}, {"pos": 5}])
def test_every_grid_shape_maps_each_cell_to_its_numbers(browser: Any, tmp_path: Path, grid: dict[str, int]) -> None:
    values = torch.randn(*grid.values(), 3, generator=torch.Generator().manual_seed(1))
    save_file({"values/m": values, "mean/m": values.mean(-1)}, str(tmp_path / "study.safetensors"))
    study = {"grid": {k: list(range(n)) for k, n in grid.items()}, "cells": values[..., 0].numel(), "examples": 3,
             "metrics": ["m"], "mean": {}, "ci": None, "tokens": [f"t{i}" for i in range(5)]}  # fmt: skip
    write_report_html({"mode": "study", "study": study}, tmp_path)
    opened = Opened(browser, tmp_path / "report.html")
    menus = opened.page.locator(".heatmap select")
    assert menus.count() == len(grid) - 2 if len(grid) > 2 else menus.count() == 0
    if menus.count():
        menus.first.select_option("2")  # head 2: the third panel
    at = (2, 1, 3) if len(grid) == 3 else (4,)
    index = int(torch.arange(values[..., 0].numel()).reshape(values.shape[:-1])[at])  # row-major, as study.csv
    opened.page.hover(f'rect[data-cell="{index}"]')
    tip = opened.page.text_content("#tip")
    where = ", ".join(f"{k} = {i}" for k, i in zip(grid, at)) + f' "t{at[-1]}"'
    assert where in tip and f"m mean {g4(values[at].mean())}" in tip and "CI" not in tip
    assert opened.page.locator("rect[data-cell]").count() == math.prod(list(grid.values())[-2:])
    opened.assert_clean()


def test_a_generation_page_shows_both_continuations_side_by_side(browser: Any, tmp_path: Path) -> None:
    report = run_job(composed("+model=induction_lm", "mode=generate", "+actions=scale_attention",
                              "actions.scale_attention.value=0", "generate.max_new_tokens=5"), tmp_path)  # fmt: skip
    row = report["generate"]["prompts"][0]
    opened = Opened(browser, tmp_path / "report.html")
    sides = opened.page.locator("#generation .side pre").all_inner_texts()
    assert [s.replace(" ", "") for s in sides] == [row["unmodified"].replace(" ", ""), row["surgered"].replace(" ", "")]
    marked = opened.page.locator("#generation .side mark").all_inner_texts()
    assert row["first_difference"] == 0 and [m.replace(" ", "") for m in marked] == [s.replace(" ", "") for s in sides]
    opened.assert_clean()


def test_a_circuit_json_gives_the_graph_and_the_faithfulness_curve(browser: Any, tmp_path: Path) -> None:
    edges = [{"sender": "embed", "receiver": "attn.0", "score": 2.0}, {"sender": "attn.0", "receiver": "logits",
             "score": -1.0}, {"sender": "mlp.0", "receiver": f"logits{HOSTILE}", "score": 0.5},
             {"sender": "head.1.2", "receiver": "mlp.1", "score": 0.25}]  # fmt: skip
    circuit = {  # the shape surgery/circuit writes (SPEC §21), made by hand
        "nodes": {"senders": ["embed", "attn.0", "mlp.0", "head.1.2"], "receivers": ["attn.0", "mlp.1", "logits"]},
        "edges": edges,
        "faithfulness": [{"edges": 1, "mean": {"ld": 1.0}, "faithfulness": {"ld": 0.4}},
                         {"edges": 3, "mean": {"ld": 2.0}, "faithfulness": {"ld": 0.9}}],
        "verify": {"metric": "ld", "edges": ["embed->attn.0", "attn.0->logits"], "estimate": [1.5, -0.5],
                   "exact": [2.0, -1.0], "pearson": 1.0, "spearman": 1.0},
    }  # fmt: skip
    (tmp_path / "circuit.json").write_text(json.dumps(circuit))
    write_report_html({"mode": "circuit"}, tmp_path)
    opened = Opened(browser, tmp_path / "report.html")
    lines = opened.page.locator("#circuit svg.graph path.edge")
    assert lines.count() == 4 and opened.page.locator("#circuit svg.graph circle.node").count() == 7
    assert f"logits{HOSTILE}" in opened.page.locator("#circuit svg.graph text.label").all_text_contents()
    assert lines.nth(3).get_attribute("class") == "edge up" and "embed → attn.0: 2" in lines.nth(3).text_content()
    widths = [float(lines.nth(i).get_attribute("stroke-width")) for i in range(4)]
    assert widths == sorted(widths)  # the strongest drawn last, widest
    curve, scatter = opened.page.locator("#circuit svg.chart").all()
    assert curve.locator("polyline.curve").count() == 1
    assert curve.locator("circle.dot").all_text_contents() == [
        "no edge: 0",
        "top 1 edges: faithfulness 0.4",
        "top 3 edges: faithfulness 0.9",
        "every edge (4): 1",
    ]
    assert "faithfulness (ld)" in curve.text_content()
    assert scatter.locator("circle.dot").all_text_contents()[0] == "embed->attn.0: exact 2, estimated 1.5"
    opened.assert_clean()


def test_a_splice_page_lists_its_top_features_at_their_tokens(browser: Any, tmp_path: Path) -> None:
    from surgery.lm.text import encode_prompts, load_tokenizer
    from surgery.models.induction import WEIGHTS
    from tests.splice_helpers import sae_tensors, write_saelens

    write_saelens(tmp_path / "sae", sae_tensors(64, 32))
    sae = tmp_path / "sae"
    splice = f"+actions.sae={{kind: splice, select: model.layers.1, module: {{path: '{sae}'}}, capture: true}}"
    run_job(composed("+model=induction_lm", splice), tmp_path / "run")
    acts = load_file(tmp_path / "run" / "captures.safetensors")["sae/model.layers.1/features"]  # [1, positions, 32]
    peak = acts.amax(dim=(0, 1))
    feature = int(peak.argmax())
    pos = int(acts[0, :, feature].argmax())
    tok = load_tokenizer(model_path=WEIGHTS)
    ids = encode_prompts(tok, prompt=composed("+model=induction_lm").model.input.prompt).input_ids[0]
    opened = Opened(browser, tmp_path / "run" / "report.html")
    first = opened.page.locator("#splice tbody tr").first
    assert first.locator("td").first.inner_text() == str(feature)
    assert first.locator("td").nth(1).inner_text() == g4(peak[feature])
    assert first.locator("mark").first.inner_text() == tok.decode([int(ids[pos])])
    opened.assert_clean()


def test_the_docs_example_writes_the_page_again_from_a_run_directory(study_dir: Path, tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "report.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, re.S)
    run = tmp_path / "run"
    shutil.copytree(study_dir, run)
    (run / "report.html").unlink()
    exec(block.replace('"outputs/2026-11-28/12-00-00"', repr(str(run))), {})  # noqa: S102
    data = r'id="report-data">.*?</script>'
    again, first = ((d / "report.html").read_text() for d in (run, study_dir))
    assert re.search(data, again).group(0) == re.search(data, first).group(0)
