"""Named baselines for normalize, and ``all`` meaning every value a variable can take (SPEC §20, issue 39).

Each number is checked against the same computation written with plain hooks (tests/test_study.py's
hand loop): causal tracing normalized between the noised and the clean run, TransformerLens's
normalization of the means, examples without a scale counted, ``all`` as every block or head.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import surgery
from surgery.core.paths import config_dir
from surgery.errors import ConfigError
from tests.lm_helpers import tiny_gpt2
from tests.test_study import METRICS, PATCH, hand_patching

NOISE = {"noise": {"kind": "modify_output", "select": "transformer.wte", "op": "add", "value": 0.5, "passes": "main"}}
GRID = {"layer": "0:2", "pos": "all"}


def _diff(model, ids, shift: float | None = None) -> torch.Tensor:
    """logit[3] - logit[4] at the last position per example (with the embeddings shifted, as the noise does)."""
    handle = model.transformer.wte.register_forward_hook(lambda m, a, o: o + shift) if shift is not None else None
    with torch.no_grad():
        z = model(ids).logits[:, -1].double()
    if handle is not None:
        handle.remove()
    return z[:, 3] - z[:, 4]


def test_causal_tracing_normalizes_between_the_noised_run_and_the_clean_one(tiny_lm) -> None:
    model, clean, _ = tiny_lm
    actions = {**NOISE, **PATCH}
    scale = {"zero": ["noise"], "one": "unmodified"}
    result = surgery.study(model, actions, GRID, clean, METRICS[:1], source=clean, normalize=scale, batch_cells=1)
    raw = hand_patching(model, clean, clean, shift_embed=0.5)  # restore each (layer, pos) into the noised run
    noised, unmodified = _diff(model, clean, 0.5), _diff(model, clean)
    assert torch.equal(result.values["logit_diff"], (raw - noised) / (unmodified - noised))
    assert torch.equal(result.baselines["noise"]["logit_diff"], noised)
    assert result.normalization == {"zero": ["noise"], "one": "unmodified", "over": "example",
                                    "metric": "logit_diff", "zero_denominators": 0}  # fmt: skip


def test_the_default_normalization_of_a_causal_trace_is_refused_not_all_nan(tiny_lm) -> None:
    """The unmodified run and the source are both clean: every denominator is 0 (the finding of issue 39)."""
    model, clean, _ = tiny_lm
    with pytest.raises(ConfigError, match=r"^study.normalize: every example .* \{zero: \[noise\], one: unmodified\}"):
        surgery.study(model, {**NOISE, **PATCH}, GRID, clean, METRICS[:1], source=clean, normalize=True)


def test_normalize_mean_scales_the_means_as_transformerlens_does(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    result = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, normalize="mean", batch_cells=1)
    raw = hand_patching(model, clean, corrupt)
    low, high = _diff(model, corrupt).mean(), _diff(model, clean).mean()
    assert torch.equal(result.values["logit_diff"], (raw - low) / (high - low))
    assert torch.allclose(result.mean["logit_diff"], (raw.mean(-1) - low) / (high - low), rtol=1e-12)
    per_example = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, normalize=True)
    assert not torch.allclose(per_example.mean["logit_diff"], result.mean["logit_diff"])  # they differ: say which


def test_examples_without_a_scale_are_counted_and_left_out(tiny_lm) -> None:
    model, clean, corrupt = tiny_lm
    corrupt = corrupt.clone()
    corrupt[0] = clean[0]  # example 0 scores the same clean and corrupted
    result = surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, normalize=True, batch_cells=1)
    assert result.normalization["zero_denominators"] == 1
    assert result.values["logit_diff"][..., 0].isnan().all() and not result.mean["logit_diff"].isnan().any()


@pytest.mark.parametrize(
    ("normalize", "message"),
    [
        ("median", "study.normalize: true, false, mean or {zero: BASELINE"),
        ({"zero": ["nope"]}, "study.normalize.zero: 'nope' is not an action of this study"),
        ({"zero": ["patch"]}, "study.normalize.zero: 'patch' changes with the grid ({layer})"),
        ({"zero": "unmodified", "one": "unmodified"}, "study.normalize: zero and one are the same baseline"),
        ({"zero": "unmodified", "over": "median"}, "study.normalize.over: 'median' is not one of example, mean"),
        ({"zero": "unmodified", "two": 1}, "study.normalize.two: unknown key"),
    ],
)
def test_a_bad_normalization_is_refused_before_any_cell_runs(tiny_lm, normalize, message) -> None:
    model, clean, corrupt = tiny_lm
    with pytest.raises(ConfigError) as caught:
        surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], source=clean, normalize=normalize)
    assert str(caught.value).startswith(message), caught.value


def test_the_source_baseline_needs_a_source(tiny_lm) -> None:
    model, _, corrupt = tiny_lm
    with pytest.raises(ConfigError, match="^study.normalize: the source baseline needs a source input"):
        surgery.study(model, PATCH, GRID, corrupt, METRICS[:1], normalize="mean")


# ---------------------------------------------------------------- all


SITE_PATCH = {
    "cap": {"kind": "capture", "select": "@resid_pre.{layer}"},
    "patch": {"kind": "modify_input", "select": "@resid_pre.{layer}", "op": "set", "index": "[:, {pos}]",
              "from": {"capture": "cap"}},
}  # fmt: skip


def test_all_means_every_block_for_a_site_number_and_every_position_for_an_index() -> None:
    model = tiny_gpt2(20, 1, n_layer=3)
    ids = torch.randint(2, 20, (2, 4), generator=torch.Generator().manual_seed(0))
    result = surgery.study(model, SITE_PATCH, {"layer": "all", "pos": "all"}, ids, ["kl"], source=ids.flip(0))
    assert result.grid == {"layer": [0, 1, 2], "pos": [0, 1, 2, 3]}


def test_all_means_every_block_for_a_transformerlens_hook_name_too() -> None:
    model = tiny_gpt2(20, 1, n_layer=3)
    ids = torch.randint(2, 20, (2, 4), generator=torch.Generator().manual_seed(0))
    tl = {"a": {"kind": "modify_output", "select": "blocks.{layer}.hook_resid_post", "op": "add", "value": 1.0}}
    assert surgery.study(model, tl, {"layer": "all"}, ids, ["kl"]).grid == {"layer": [0, 1, 2]}


def test_all_means_every_head_for_head() -> None:
    model = tiny_gpt2(20, 1, n_head=4)
    ids = torch.randint(2, 20, (2, 4), generator=torch.Generator().manual_seed(0))
    ablate = {"a": {"kind": "modify_input", "select": "@heads.0", "head": "{h}", "op": "zero"}}
    assert surgery.study(model, ablate, {"h": "all"}, ids, ["kl"]).grid == {"h": [0, 1, 2, 3]}


def test_all_for_a_variable_used_two_ways_is_refused() -> None:
    model = tiny_gpt2(20, 1)
    ids = torch.randint(2, 20, (2, 4), generator=torch.Generator().manual_seed(0))
    both = {"a": {"kind": "modify_output", "select": "@resid_post.{x}", "op": "add", "value": 1.0, "index": "[:, {x}]"}}
    with pytest.raises(ConfigError, match=r"^study.grid.x: 'all' is ambiguous: \{x\} is used as blocks at"):
        surgery.study(model, both, {"x": "all"}, ids, ["kl"])


def test_the_shipped_patching_study_covers_every_block() -> None:
    shipped = OmegaConf.to_container(OmegaConf.load(config_dir() / "study" / "patch_layer_pos.yaml"))
    model = tiny_gpt2(20, 1, n_layer=3)
    ids = torch.randint(2, 20, (1, 4), generator=torch.Generator().manual_seed(0))
    result = surgery.study(model, shipped["actions"], shipped["study"]["grid"], ids, ["kl"], source=ids.flip(1))
    assert result.grid["layer"] == [0, 1, 2]
