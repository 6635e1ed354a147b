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
    """Block 0's first-word head feeds block 1's attention, whose head 0 writes to the MLP that gives the answer;
    the six top edges alone keep the answer."""
    out, report = induction
    circuit = json.loads((out / "circuit.json").read_text())
    top = [f"{e['sender']} -> {e['receiver']}" for e in circuit["edges"][:6]]
    for edge in ("head.0.3 -> attn.1", "head.1.0 -> mlp.1", "mlp.1 -> logits", "head.0.0 -> mlp.1"):
        assert edge in top, top
    six = next(row for row in circuit["faithfulness"] if row["edges"] == 6)
    assert six["faithfulness"]["logit_diff"] > 0.9
    assert report["circuit"]["edges"] == len(circuit["edges"]) == 33


def test_the_heads_do_what_the_experiment_says(induction: tuple[Path, dict]) -> None:
    """Head 0.3 reads the first word from the repeat's positions; head 1.0 reads where that word comes again."""
    from surgery.models.induction import induction_lm

    out, report = induction
    prompts = report["data"]["prompts"]
    from transformers import PreTrainedTokenizerFast

    from surgery.models.induction import WEIGHTS

    tok = PreTrainedTokenizerFast.from_pretrained(str(WEIGHTS))
    ids = torch.tensor([tok(p)["input_ids"] for p in prompts])
    with torch.no_grad():
        attentions = induction_lm()(ids, output_attentions=True).attentions
    assert (attentions[0][:, 3, 9:].argmax(-1) == 1).float().mean() > 0.7  # the second copy reads position 1
    assert (attentions[1][:, 0, -1].argmax(-1) == 9).float().mean() > 0.7  # the last word reads the repeat's start


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
