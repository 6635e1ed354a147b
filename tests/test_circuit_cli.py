"""A circuit study from the command line (SPEC §21): the shipped induction_circuit experiment and its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from surgery.app.job import run_job
from surgery.errors import ConfigError
from tests.test_cli import composed


@pytest.fixture(scope="module")
def induction(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("circuit")
    report = run_job(composed("+experiment=induction_circuit"), out)
    return out, report


def test_the_induction_circuit_is_found(induction: tuple[Path, dict]) -> None:
    """Block 0's previous-token head feeds block 1's induction heads among the top three edges; the induction
    heads reach the logits directly and through mlp.1; the twelve top edges alone keep the answer."""
    out, report = induction
    circuit = json.loads((out / "circuit.json").read_text())
    top = [f"{e['sender']} -> {e['receiver']}" for e in circuit["edges"]]
    assert "head.0.3 -> attn.1" in top[:3], top
    for edge in ("embed -> attn.1", "mlp.1 -> logits", "head.1.0 -> mlp.1", "head.1.0 -> logits"):
        assert edge in top[:12], top
    twelve = next(row for row in circuit["faithfulness"] if row["edges"] == 12)
    assert twelve["faithfulness"]["logit_diff"] > 0.95
    assert report["circuit"]["edges"] == len(circuit["edges"]) == 33


def test_the_heads_do_what_the_experiment_says(induction: tuple[Path, dict]) -> None:
    """Head 0.3 attends to the previous token; from the last word, block 1's heads attend to the word after its
    earlier occurrence (position 5, the word to copy)."""
    from surgery.models.induction import induction_lm

    out, report = induction
    prompts = report["data"]["prompts"]
    from transformers import PreTrainedTokenizerFast

    from surgery.models.induction import WEIGHTS

    tok = PreTrainedTokenizerFast.from_pretrained(str(WEIGHTS))
    ids = torch.tensor([tok(p)["input_ids"] for p in prompts])
    with torch.no_grad():
        attentions = induction_lm()(ids, output_attentions=True).attentions
    position = torch.arange(1, ids.shape[1])
    assert (attentions[0][:, 3, position].argmax(-1) == position - 1).float().mean() > 0.9  # one token back
    assert (attentions[1][:, :, -1].argmax(-1) == 5).all()  # every induction head, every prompt: the 5th word


def test_the_files(induction: tuple[Path, dict]) -> None:
    out, _ = induction
    tensors = load_file(out / "circuit.safetensors")
    assert tensors["scores/logit_diff"].shape == (33,) and tensors["values/logit_diff"].shape == (33, 8)
    for name in ("plots/circuit.png", "plots/faithfulness.png", "report.md", "report.json"):
        assert (out / name).stat().st_size > 0
    assert "![circuit](plots/circuit.png)" in (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    top = json.loads((out / "circuit.json").read_text())["edges"][0]
    assert '"circuit"' in page and top["sender"] in page and top["receiver"] in page  # the graph's data, inline


def test_eap_with_verify_top(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_job(composed("+experiment=induction_circuit", "study.method=eap", "+study.verify_top=5"), tmp_path)
    assert "circuit: 33 edges × 8 examples (eap" in capsys.readouterr().out
    run = tmp_path
    verify = json.loads((run / "circuit.json").read_text())["verify"]
    assert len(verify["exact"]) == 5 and verify["pearson"] > 0.5
    assert (run / "plots" / "circuit_verify.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("overrides", "says"),
    [(("model=bert_tiny",), "circuits need a pre-norm decoder"), (("study.nodes=neurons",), "study.nodes"),
     (("+actions=ablate_mlp",), "actions: a circuit study"), (("+study.grid={layer: all}",), "grid")],
)  # fmt: skip
def test_refusals(tmp_path: Path, overrides: tuple[str, ...], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        run_job(composed("+experiment=induction_circuit", *overrides), tmp_path)
