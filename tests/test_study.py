"""surgery.study: a layer × position patching grid on a tiny GPT-2, against the same hooks written by hand.

The unmodified run and the source pass run once per batch; every cell applies its plan (compiled
once) and scores every example. Each number is compared bit for bit with a hand loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import surgery
from surgery.errors import ConfigError, NoMatchError

PATCH = {
    "cap": {"kind": "capture", "select": "transformer.h.{layer}", "what": ["input"]},
    "patch": {"kind": "modify_input", "select": "transformer.h.{layer}", "op": "set", "index": "[:, {pos}]",
              "from": {"capture": "cap", "what": "input"}},
}  # fmt: skip
METRICS = [{"logit_diff": {"correct": 3, "wrong": 4}}, {"prob": {"token": 3}}]


def hidden_in(a: tuple, k: dict) -> torch.Tensor:
    return a[0] if a else k["hidden_states"]


def with_hidden(a: tuple, k: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    return ((x, *a[1:]), k) if a else (a, {**k, "hidden_states": x})


def hand_patching(model, clean, corrupt, shift_embed: float | None = None, noise_clean: bool = False) -> torch.Tensor:
    """logit[3] - logit[4] at the last position, per layer, position and example, written with plain hooks."""
    out = torch.empty(2, clean.shape[1], clean.shape[0], dtype=torch.float64)
    with torch.no_grad():
        for layer in range(2):
            block, store = model.transformer.h[layer], {}
            noise = None
            if shift_embed is not None:
                noise = model.transformer.wte.register_forward_hook(lambda m, a, o: o + shift_embed)
            if noise is not None and not noise_clean:
                noise.remove()
            h = block.register_forward_pre_hook(
                lambda m, a, k, store=store: store.__setitem__("x", hidden_in(a, k)), with_kwargs=True
            )
            model(clean)
            h.remove()
            if noise is not None and noise_clean:
                noise.remove()
            for pos in range(clean.shape[1]):

                def pre(m, a, k, pos=pos, store=store):
                    x = hidden_in(a, k).clone()
                    x[:, pos] = store["x"][:, pos]
                    return with_hidden(a, k, x)

                handles = [block.register_forward_pre_hook(pre, with_kwargs=True)]
                if shift_embed is not None:
                    handles.append(model.transformer.wte.register_forward_hook(lambda m, a, o: o + shift_embed))
                z = model(corrupt).logits[:, -1].double()
                for handle in handles:
                    handle.remove()
                out[layer, pos] = z[:, 3] - z[:, 4]
    return out


def test_a_patching_grid_equals_the_hand_loop_bit_for_bit_and_restores_the_model(tiny_lm, tmp_path: Path) -> None:
    model, clean, corrupt = tiny_lm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grid = {"layer": "0:2", "pos": "all"}
    result = surgery.study(model, PATCH, grid, corrupt, METRICS, source=clean, ci=0.9, batch_cells=1)
    assert torch.equal(result.values["logit_diff"], hand_patching(model, clean, corrupt))
    z = model(corrupt).logits[:, -1].double()
    assert torch.equal(result.baselines["unmodified"]["prob"], torch.softmax(z, -1)[:, 3])
    assert result.values["prob"].shape == (2, 5, 3)
    assert torch.equal(result.mean["prob"], result.values["prob"].mean(-1))
    assert (result.ci_low["logit_diff"] <= result.mean["logit_diff"]).all()
    assert result.cells[:2] == [{"layer": 0, "pos": 0}, {"layer": 0, "pos": 1}]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    rows = result.to_csv(tmp_path / "study.csv").read_text().splitlines()
    assert rows[0] == "layer,pos,metric,mean,ci_low,ci_high" and len(rows) == 1 + 2 * 5 * 2
    assert rows[1].startswith(f"0,0,logit_diff,{float(result.mean['logit_diff'][0, 0])!r},")
    assert [p.name for p in result.plot(tmp_path / "plots")] == ["study_logit_diff.png", "study_prob.png"]


def test_normalize_scales_the_first_metric_per_example_between_unmodified_and_source(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    grid = {"layer": [1], "pos": [1, 4]}
    result = surgery.study(model, PATCH, grid, corrupt, METRICS, source=clean, normalize=True, batch_cells=1)
    raw = hand_patching(model, clean, corrupt)[1:, [1, 4]]
    with torch.no_grad():
        zc, zx = model(clean).logits[:, -1].double(), model(corrupt).logits[:, -1].double()
    src, unmod = zc[:, 3] - zc[:, 4], zx[:, 3] - zx[:, 4]
    assert torch.equal(result.values["logit_diff"], (raw - unmod) / (src - unmod))
    assert result.normalized == "logit_diff" and "prob" in result.values  # later metrics stay raw


def test_passes_main_keeps_a_traces_noise_out_of_the_shared_clean_pass(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    shift = {"kind": "modify_output", "select": "transformer.wte", "op": "add", "value": 0.5, "passes": "main"}
    noise, grid = {"noise": shift}, {"layer": "0:2", "pos": "all"}
    result = surgery.study(model, {**noise, **PATCH}, grid, corrupt, METRICS[:1], source=clean, batch_cells=1)
    assert torch.equal(result.values["logit_diff"], hand_patching(model, clean, corrupt, shift_embed=0.5))
    both = {"noise": {**noise["noise"], "passes": "both"}}  # the clean pass is noised too: each cell runs its own
    result = surgery.study(model, {**both, **PATCH}, grid, corrupt, METRICS[:1], source=clean)
    assert torch.equal(result.values["logit_diff"], hand_patching(model, clean, corrupt, 0.5, noise_clean=True))


def test_batches_give_the_same_values_as_one_batch(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    grid = {"layer": [0], "pos": [1, 2]}
    whole = surgery.study(model, PATCH, grid, corrupt, METRICS, source=clean, batch_cells=1)
    split = surgery.study(model, PATCH, grid, corrupt, METRICS, source=clean, batch_size=2, batch_cells=1)
    assert torch.allclose(whole.values["prob"], split.values["prob"], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("grid", "options", "error", "message"),
    [
        ({"layer": [0, 5], "pos": [0]}, {}, NoMatchError, "study cell {layer: 5, pos: 0}: actions.cap"),
        ({"layer": [0], "pos": [0], "head": [1]}, {}, ConfigError, "study.grid.head: no action uses it"),
        ({"layer": [0], "pos": [9]}, {}, ConfigError, "study cell {layer: 0, pos: 9}: "),
        (
            {"layer": [0], "pos": [0]},
            {"normalize": True, "source": None},
            ConfigError,
            "study.normalize: the source baseline needs a source input",
        ),
        ({"layer": [0], "pos": [0]}, {"method": "atp"}, ConfigError, "study.method: 'atp' is not one of"),
    ],
)
def test_a_cell_that_cannot_run_is_refused_before_any_cell_runs(tiny_lm, grid, options, error, message) -> None:
    model, clean, corrupt = tiny_lm
    options = {"source": clean, **options}
    calls = []
    handle = model.register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        with pytest.raises(error) as e:
            surgery.study(model, PATCH, grid, corrupt, METRICS, **options)
    finally:
        handle.remove()
    assert str(e.value).startswith(message)
    assert len(calls) <= 2  # the probe (and, to name the cell, its own probe), never a cell


def test_a_classifier_study_scores_labels_per_example() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    actions = {"scale": {"kind": "modify_output", "select": "1", "op": "mul", "value": "{coef}"}}
    result = surgery.study(model, actions, {"coef": [0.0, 1.0, 2.0]}, x, ["loss", "accuracy"], labels=y)
    with torch.no_grad():
        for i, coef in enumerate([0.0, 1.0, 2.0]):
            z = model[2](model[1](model[0](x)) * coef).double()
            assert torch.equal(result.values["loss"][i], torch.nn.functional.cross_entropy(z, y, reduction="none"))
            assert torch.equal(result.values["accuracy"][i], (z.argmax(-1) == y).double())


def test_cells_share_forwards_by_rows_and_give_the_values_of_one_forward_per_cell(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    grid = {"layer": "0:2", "pos": "all"}
    forwards: list[int] = []
    handle = model.register_forward_hook(lambda m, a, o: forwards.append(int(o.logits.shape[0])))
    try:
        one = surgery.study(model, PATCH, grid, corrupt, METRICS, source=clean, batch_cells=1)
        one_count = len(forwards)
        forwards.clear()
        shared = surgery.study(model, PATCH, grid, corrupt, METRICS, source=clean, batch_cells=4)
    finally:
        handle.remove()
    # unmodified (every cell's index checked on it), the shared source pass (also the source baseline), then 10
    # cells: one forward each, or 3 forwards of up to 4 cells × 3 rows (the source read per row, not run again)
    assert one_count == 1 + 1 + 10
    assert forwards == [3, 3, 12, 12, 12]
    for name in ("logit_diff", "prob"):
        assert torch.allclose(shared.values[name], one.values[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"kind": "replace_forward", "select": "transformer.h.{layer}.mlp", "fn": "zero"}, "does not act per example"),
        ({"kind": "modify_output", "select": "transformer.h.{layer}", "op": "add", "value": 1.0, "index": "[0, {pos}]"},
         "its first subscript picks rows"),
        ({"kind": "modify_output", "select": "transformer.h.{layer}", "op": "add", "value": 1.0, "index": "[:, {pos}]"},
         "changes the source pass too"),
    ],
)  # fmt: skip
def test_cells_that_do_not_act_per_row_refuse_shared_forwards_and_run_one_each(tiny_lm, change, why) -> None:
    model, clean, corrupt = tiny_lm
    actions, grid = {"c": change}, {"layer": [0, 1], **({"pos": [1]} if "{pos}" in str(change) else {})}
    with pytest.raises(ConfigError, match=f"^study.batch_cells: 2 cells cannot share a forward: actions.c.*{why}"):
        surgery.study(model, actions, grid, corrupt, METRICS, source=clean, batch_cells=2)
    auto = surgery.study(model, actions, grid, corrupt, METRICS, source=clean)
    one = surgery.study(model, actions, grid, corrupt, METRICS, source=clean, batch_cells=1)
    assert torch.equal(auto.values["prob"], one.values["prob"])
