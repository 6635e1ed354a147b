"""Per-example study metrics against the same numbers written in plain torch, bit for bit."""

from __future__ import annotations

import pytest
import torch

from surgery.errors import ConfigError
from surgery.lm.text import IGNORE
from surgery.study.metrics import parse_metrics, per_example
from tests.lm_helpers import word_tokenizer

torch.manual_seed(0)
LOGITS = torch.randn(3, 5, 11)
REFERENCE = torch.randn(3, 5, 11)
LABELS = torch.tensor([[IGNORE, 1, 2, 3, 4], [5, 6, 7, 8, 9], [IGNORE, IGNORE, 2, 3, 1]])  # row 0, 2: left padding


def at_last(z: torch.Tensor) -> torch.Tensor:
    return z[:, -1].double()  # left padding: the last position is every row's last real token


def test_token_metrics_equal_plain_torch_at_the_last_real_position() -> None:
    z = at_last(LOGITS)
    assert torch.equal(per_example("logit_diff", {"correct": 4, "wrong": 7})(LOGITS, LABELS), z[:, 4] - z[:, 7])
    assert torch.equal(per_example("prob", {"token": 4})(LOGITS, LABELS), torch.softmax(z, -1)[:, 4])
    assert torch.equal(per_example("logit", {"token": 2})(LOGITS, LABELS), z[:, 2])
    ranks = torch.tensor([sorted(row.tolist(), reverse=True).index(row[4].item()) for row in z], dtype=torch.float64)
    assert torch.equal(per_example("rank", {"token": 4})(LOGITS, LABELS), ranks)


def test_pos_scores_another_position() -> None:
    z = LOGITS[:, 2].double()
    assert torch.equal(per_example("prob", {"token": 3, "pos": 2})(LOGITS, LABELS), torch.softmax(z, -1)[:, 3])
    assert torch.equal(per_example("logit", {"token": 3, "pos": -3})(LOGITS, LABELS), z[:, 3])


def test_right_padding_scores_each_rows_last_real_token() -> None:
    labels = torch.tensor([[1, 2, IGNORE, IGNORE, IGNORE], [1, 2, 3, 4, 5], [1, 2, 3, IGNORE, IGNORE]])
    rows = LOGITS[torch.arange(3), torch.tensor([1, 4, 2])].double()
    assert torch.equal(per_example("logit", {"token": 0})(LOGITS, labels), rows[:, 0])


def test_loss_is_each_rows_mean_next_token_cross_entropy_over_real_tokens() -> None:
    got = per_example("loss")(LOGITS, LABELS)
    for row in range(3):
        keep = [t for t in range(4) if LABELS[row, t] != IGNORE and LABELS[row, t + 1] != IGNORE]
        z = LOGITS[row, keep].double()
        want = torch.nn.functional.cross_entropy(z, LABELS[row, [t + 1 for t in keep]])
        assert torch.allclose(got[row], want, rtol=1e-12, atol=0)


def test_kl_and_accuracy_per_example() -> None:
    p, q = torch.log_softmax(at_last(REFERENCE), -1), torch.log_softmax(at_last(LOGITS), -1)
    want = torch.stack([torch.sum(p[i].exp() * (p[i] - q[i])) for i in range(3)])
    assert torch.allclose(per_example("kl")(LOGITS, LABELS, REFERENCE), want, rtol=1e-12, atol=0)
    classes, labels = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    want_acc = (classes.argmax(-1) == labels).double()
    assert torch.equal(per_example("accuracy")(classes, labels), want_acc)


def test_token_texts_resolve_with_the_tokenizer_and_must_be_one_token() -> None:
    tok = word_tokenizer(["w1 w2 w3 w4"])
    bound = parse_metrics([{"logit_diff": {"correct": "w3", "wrong": "w4"}}, "kl"], tok)
    ids = tok("w3 w4", add_special_tokens=False)["input_ids"]
    z = at_last(LOGITS)
    assert torch.equal(bound[0](LOGITS, LABELS), z[:, ids[0]] - z[:, ids[1]])
    with pytest.raises(ConfigError, match=r"study.metrics\[0\].prob.token: 'w3 w4' is 2 tokens"):
        parse_metrics([{"prob": {"token": "w3 w4"}}], tok)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (["nope"], "study.metrics[0].nope: unknown per-example metric"),
        ([{"prob": {"tok": 3}}], "study.metrics[0].prob: takes token; got ['tok']"),
        ([{"prob": {"token": 3, "pos": "last"}}], "study.metrics[0].prob.pos: a position"),
        ([{"prob": {"token": " w"}}], "study.metrics[0].prob.token: ' w' is a text, but there is no tokenizer"),
        (["kl", "kl"], "study.metrics: kl is listed twice"),
        ([], "study.metrics: a list of metrics"),
        ([{"loss": {"token": 1}}], "study.metrics[0].loss: takes nothing but pos"),
    ],
)
def test_bad_metric_specs_are_refused_naming_the_key(spec, message) -> None:
    with pytest.raises(ConfigError) as e:
        parse_metrics(spec)
    assert str(e.value).startswith(message)
