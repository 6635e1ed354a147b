"""loss: a per-example metric (SPEC §14): the backward pass starts from its mean over the examples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from surgery.app.job import run_job
from surgery.errors import ConfigError
from surgery.lm.load import load_pretrained
from surgery.lm.text import encode_prompts, load_tokenizer
from tests.test_cli import composed
from tests.test_lm_cli import lm_dir  # noqa: F401 - the saved GPT-2 fixture

PROMPTS = "input.prompts=[the cat sat on the,the dog ran in the]"
GRAD = "+actions.g={kind: capture_grad, select: transformer.h.1, what: grad_output}"


def test_the_backward_of_a_logit_difference_equals_the_one_by_hand(lm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    loss = "loss={logit_diff: {correct: mat, wrong: park}}"
    run_job(composed("+model=hf", f"model.path={lm_dir}", "+input=text", PROMPTS, GRAD, "backward=true", loss),
            tmp_path)  # fmt: skip
    captured = load_file(tmp_path / "captures.safetensors")["g/transformer.h.1/grad_output.0"]
    model, tok = load_pretrained(lm_dir), load_tokenizer(model_path=lm_dir)
    batch = encode_prompts(tok, prompts=["the cat sat on the", "the dog ran in the"])
    held = {}
    handle = model.transformer.h[1].register_forward_hook(lambda m, a, o: held.__setitem__("o", o))
    z = model(**batch.kwargs()).logits[:, -1].double()
    handle.remove()
    held["o"].retain_grad()
    mat, park = (tok.convert_tokens_to_ids(t) for t in ("mat", "park"))
    (z[:, mat] - z[:, park]).mean().backward()
    assert torch.equal(captured, held["o"].grad)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        ("loss={rank: {token: mat}}", "loss: a per-example metric as loss is one of logit_diff, prob, logit"),
        ("loss={prob: {token: the cat}}", "loss.prob.token: 'the cat' is 2 tokens"),
        ("loss={logit_diff: {correct: mat}}", "loss.logit_diff: takes correct, wrong"),
    ],
)
def test_a_loss_metric_that_cannot_be_is_refused_before_running(lm_dir: Path, tmp_path: Path, loss, message) -> None:  # noqa: F811
    with pytest.raises(ConfigError) as e:
        run_job(composed("+model=hf", f"model.path={lm_dir}", "+input=text", PROMPTS, "backward=true", loss), tmp_path)
    assert str(e.value).startswith(message)
