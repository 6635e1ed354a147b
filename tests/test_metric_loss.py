"""A per-example metric as a training loss (surgery.integrations.loss): the same numbers as the metric by hand,
and a transformers Trainer trained on it steps like the same loop written by hand."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from surgery.errors import ConfigError
from surgery.integrations.loss import metric_loss
from tests.lm_helpers import tiny_gpt2

DIFF = {"logit_diff": {"correct": 3, "wrong": 4}}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.fixture(scope="module")
def model_and_ids() -> tuple[torch.nn.Module, torch.Tensor]:
    ids = torch.randint(5, 20, (4, 6), generator=torch.Generator().manual_seed(1))
    return tiny_gpt2(20, 1, **NO_DROPOUT), ids


def hand_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    z = model(input_ids=ids).logits[:, -1].double()
    return -(z[:, 3] - z[:, 4]).mean()


def test_the_loss_is_the_metric_mean_and_its_gradient_the_hand_written_one(model_and_ids) -> None:
    model, ids = model_and_ids
    ours = metric_loss(DIFF, scale=-1)(model(input_ids=ids))
    ours.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    theirs = hand_loss(model, ids)
    theirs.backward()
    assert torch.equal(ours, theirs)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    model.zero_grad(set_to_none=True)


def test_a_trainer_on_a_metric_loss_steps_like_the_loop_by_hand(model_and_ids, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    start, ids = model_and_ids
    model, hand = copy.deepcopy(start), copy.deepcopy(start)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, logging_steps=1, learning_rate=0.1,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        train_sampling_strategy="sequential", report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    rows = [{"input_ids": row, "labels": row} for row in ids]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   compute_loss_func=metric_loss(DIFF, scale=-1))  # fmt: skip
    trainer.train()

    hand.train()
    optimizer = torch.optim.SGD(hand.parameters(), lr=0.1)
    losses = []
    for batch in (ids[:2], ids[2:]):
        loss = hand_loss(hand, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    for ours, theirs in zip(model.state_dict().values(), hand.state_dict().values()):  # the Trainer's forward
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)  # differs from a plain call in the last bits
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))
    assert [e["loss"] for e in trainer.state.log_history if "loss" in e] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize(
    ("metric", "options", "message"),
    [
        ({"rank": {"token": 3}}, {}, "loss: rank has no gradient; a training loss takes one of logit_diff, prob"),
        ("kl", {}, "loss: kl compares with the unmodified model's run"),
        (DIFF, {"scale": 0}, "loss.scale: a non-zero number"),
        (DIFF, {"accumulation_steps": 0}, "loss.accumulation_steps: the Trainer's gradient_accumulation_steps"),
    ],
)
def test_a_loss_that_cannot_train_is_refused(metric, options, message) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        metric_loss(metric, **options)
