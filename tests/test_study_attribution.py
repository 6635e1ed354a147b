"""Attribution patching and integrated gradients over a study's cells, against the same estimate by hand.

AtP: ``(clean - corrupted activation) · ∂metric/∂activation`` at the corrupted run, summed over the
hidden dim, per example; integrated gradients average the gradient over points between the two.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import surgery
from surgery.errors import ConfigError
from tests.test_study import METRICS, PATCH, hidden_in, with_hidden

GRID = {"layer": "0:2", "pos": "all"}


def inputs_and_grads(model, clean, corrupt, alphas=None):
    """Each block's input on the clean and corrupted runs, and ∂(logit[3] - logit[4])/∂input per example."""
    with torch.no_grad():
        keep: dict[int, torch.Tensor] = {}
        hooks = [
            b.register_forward_pre_hook(lambda m, a, k, i=i: keep.__setitem__(i, hidden_in(a, k)), with_kwargs=True)
            for i, b in enumerate(model.transformer.h)
        ]
        model(clean)
        for h in hooks:
            h.remove()
    clean_in = dict(keep)
    main: dict[int, torch.Tensor] = {}

    def hold(m, a, k, i):
        x = hidden_in(a, k)
        x.retain_grad()
        main[i] = x

    hooks = [b.register_forward_pre_hook(lambda m, a, k, i=i: hold(m, a, k, i), with_kwargs=True)
             for i, b in enumerate(model.transformer.h)]  # fmt: skip
    z = model(corrupt).logits[:, -1].double()
    (z[:, 3] - z[:, 4]).sum().backward()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    grads = {i: main[i].grad for i in main}
    if alphas is not None:  # integrated gradients, layer by layer
        for i, block in enumerate(model.transformer.h):
            total = torch.zeros_like(main[i], dtype=torch.float64)
            for alpha in alphas:
                point = (main[i].detach() + alpha * (clean_in[i] - main[i].detach())).requires_grad_(True)
                h = block.register_forward_pre_hook(lambda m, a, k, p=point: with_hidden(a, k, p), with_kwargs=True)
                z = model(corrupt).logits[:, -1].double()
                (z[:, 3] - z[:, 4]).sum().backward()
                h.remove()
                model.zero_grad(set_to_none=True)
                total += point.grad.double()
            grads[i] = (total / len(alphas)).float()
    return clean_in, {i: v.detach() for i, v in main.items()}, grads


def by_hand(model, clean, corrupt, alphas=None) -> torch.Tensor:
    clean_in, main, grads = inputs_and_grads(model, clean, corrupt, alphas)
    with torch.no_grad():
        z = model(corrupt).logits[:, -1].double()
    base = z[:, 3] - z[:, 4]
    out = torch.empty(2, clean.shape[1], clean.shape[0], dtype=torch.float64)
    for layer in range(2):
        for pos in range(clean.shape[1]):
            delta = (clean_in[layer][:, pos] - main[layer][:, pos]).double()
            out[layer, pos] = base + (delta * grads[layer][:, pos].double()).sum(-1)
    return out


def test_attribution_patching_equals_the_estimate_by_hand(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    result = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, method="attribution")
    assert torch.allclose(result.values["logit_diff"], by_hand(model, clean, corrupt), rtol=1e-6, atol=1e-9)
    assert result.values["logit_diff"].shape == (2, 5, 3)
    assert all(p.grad is None for p in model.parameters())  # the backward leaves no gradient behind


def test_integrated_gradients_average_the_gradient_between_the_two_runs(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    result = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean,
                           method="integrated_gradients", steps=2)  # fmt: skip
    want = by_hand(model, clean, corrupt, alphas=[0.25, 0.75])
    assert torch.allclose(result.values["logit_diff"], want, rtol=1e-5, atol=1e-7)


def test_verify_top_runs_the_largest_estimates_exactly_and_correlates_them(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    result = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, method="attribution",
                           verify_top=4, normalize=True)  # fmt: skip
    exact = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, normalize=True, batch_cells=1)
    verify = result.verify
    assert verify is not None and len(verify["cells"]) == 4
    estimates = result.mean["logit_diff"].reshape(-1)
    order = torch.argsort(estimates.abs(), descending=True)[:4]
    assert verify["estimate"] == estimates[order].tolist()
    chosen = [exact.mean["logit_diff"].reshape(-1)[i] for i in order]
    assert torch.allclose(
        torch.tensor(verify["exact"], dtype=torch.float64), torch.stack(chosen), rtol=1e-9, atol=1e-12
    )
    assert -1 <= verify["pearson"] <= 1 and -1 <= verify["spearman"] <= 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "integrated_gradients"}, "study.steps: integrated_gradients needs a number of points"),
        ({"method": "attribution", "steps": 3}, "study.steps: only for method: integrated_gradients"),
        ({"verify_top": 3}, "study.verify_top: checks an attribution's estimates"),
        ({"method": "attribution", "metrics": [{"rank": {"token": 3}}]}, "study.metrics: rank has no gradient"),
        ({"method": "integrated_gradients", "steps": 0}, "study.steps: integrated_gradients needs a number"),
    ],
)
def test_method_options_that_do_not_fit_are_refused(tiny_lm, options, message) -> None:
    model, clean, corrupt = tiny_lm
    metrics = options.pop("metrics", METRICS[:1])
    with pytest.raises(ConfigError, match=f"^{message}"):
        surgery.study(model, PATCH, GRID, corrupt, metrics, source=clean, **options)


def test_an_intervention_attribution_cannot_estimate_is_refused_before_running(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    actions = {"z": {"kind": "replace_forward", "select": "transformer.h.{layer}.mlp", "fn": "zero"}}
    with pytest.raises(ConfigError, match=r"^study.method: attribution estimates .*study cell \{layer: 0\}"):
        surgery.study(model, actions, {"layer": [0, 1]}, corrupt, METRICS[:1], method="attribution")


def test_cells_derived_from_their_group_equal_cells_compiled_one_by_one(tiny_lm, monkeypatch) -> None:
    """Cells differing only in index and value take their group's plan; compiling every cell gives the same bits."""
    model, clean, corrupt = tiny_lm
    scaled = {**PATCH, "scale": {"kind": "modify_output", "select": "transformer.h.{layer}.mlp", "op": "mul",
                                 "value": "{coef}", "index": "[:, {pos}]"}}  # fmt: skip
    grid = {**GRID, "coef": [0.5, 2]}
    fast = surgery.study(model, scaled, grid, corrupt, METRICS[:1], source=clean, method="attribution")
    monkeypatch.setattr(importlib.import_module("surgery.study.template"), "_changes", lambda *a: None)  # one plan each
    slow = surgery.study(model, scaled, grid, corrupt, METRICS[:1], source=clean, method="attribution")
    assert torch.equal(fast.values["logit_diff"], slow.values["logit_diff"])
    assert fast.values["logit_diff"][:, :, 0].ne(fast.values["logit_diff"][:, :, 1]).any()  # coef changes it


def test_an_index_that_does_not_fit_is_refused_naming_the_cell(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    grid = {"layer": "0:2", "pos": [0, 9]}  # 5 positions: [:, 9] fits no input
    message = r"^study cell \{layer: 0, pos: 9\}: actions.patch.index: \[:, 9\] does not fit the input, shape \[3, 5, "
    with pytest.raises(ConfigError, match=message):
        surgery.study(model, PATCH, grid, corrupt, METRICS[:1], source=clean, method="attribution")


def test_an_estimate_without_gradients_is_refused_before_running(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    with (
        torch.inference_mode(),
        pytest.raises(
            ConfigError,
            match=r"^study.method: attribution takes a backward"
            r" pass, and this study runs inside torch.inference",
        ),
    ):
        surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, method="attribution")
    with torch.no_grad():  # no_grad is lifted for the backward pass: the same estimates
        inside = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, method="attribution")
    outside = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, method="attribution")
    assert torch.equal(inside.values["logit_diff"], outside.values["logit_diff"])


@pytest.mark.parametrize("method", ["attribution", "integrated_gradients"])
def test_an_estimate_leaves_the_gradients_the_model_holds_as_they_were(tiny_lm, method) -> None:
    """The study takes the sites' gradients alone (autograd.grad): a training loop's ``.grad`` survives it."""
    model, clean, corrupt = tiny_lm
    held = {name: torch.full_like(p, 0.5) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = held[name].clone()
    try:
        steps = 2 if method == "integrated_gradients" else None
        surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, method=method, steps=steps)
        assert all(torch.equal(p.grad, held[name]) for name, p in model.named_parameters())
    finally:
        model.zero_grad(set_to_none=True)
