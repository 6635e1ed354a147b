"""A model wrapped by nnsight gives the same numbers as the bare model (SPEC §20, issue 39).

``NNsight(model)`` replaces every module's ``forward`` with a controller taking ``(*args, **kwargs)``;
before, a study's patch picked the wrong input (``cannot pick item 'hidden_states' from a DynamicCache``).
"""

from __future__ import annotations

import pytest
import torch

import surgery
from surgery.errors import ConfigError
from tests.lm_helpers import tiny_gpt2

nnsight = pytest.importorskip("nnsight", reason="the dev extra installs nnsight")  # set up by scripts/setup
PATCH = {
    "cap": {"kind": "capture", "select": "@resid_pre.{layer}"},
    "patch": {"kind": "modify_input", "select": "@resid_pre.{layer}", "op": "set", "index": "[:, {pos}]",
              "from": {"capture": "cap"}},
}  # fmt: skip
GRID = {"layer": "0:2", "pos": "all"}


def test_a_study_on_an_nnsight_wrapped_model_equals_the_bare_model() -> None:
    model = tiny_gpt2(20, 1)
    ids = torch.randint(2, 20, (2, 5), generator=torch.Generator().manual_seed(0))
    bare = surgery.study(model, PATCH, GRID, ids, ["kl", {"prob": {"token": 3}}], source=ids.flip(0))
    wrapped = nnsight.NNsight(model)
    for given in (wrapped, model):  # the wrapper itself, and the model whose modules it changed
        again = surgery.study(given, PATCH, GRID, ids, ["kl", {"prob": {"token": 3}}], source=ids.flip(0))
        assert torch.equal(again.values["prob"], bare.values["prob"])


def test_apply_on_a_wrapper_hooks_the_inner_model_and_removes_cleanly() -> None:
    model = tiny_gpt2(20, 1)
    ids = torch.randint(2, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    wrapped = nnsight.NNsight(model)
    with torch.no_grad():
        before = model(ids).logits
        with surgery.apply(wrapped, {"z": {"kind": "modify_input", "select": "@mlp_out.0", "op": "zero"}}) as s:
            changed = model(ids).logits
        assert s.model is model
        assert torch.equal(model(ids).logits, before) and not torch.equal(changed, before)


def test_something_that_is_no_module_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^model: expected a torch.nn.Module, got str; pass the torch module"):
        surgery.plan("gpt2", {"c": {"kind": "capture", "select": "*"}})
