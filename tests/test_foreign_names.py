"""Another family's module name on this model (``transformer.h.1.attn`` on a Llama) is refused naming the module for
the same part here and its site; the name the message gives plans when pasted."""

from __future__ import annotations

import re

import pytest

import surgery
from surgery.errors import NoMatchError
from tests.arch_zoo import build


@pytest.mark.parametrize(
    ("family", "pattern", "says"),
    [
        ("llama", "transformer.h.1", "That is gpt2's name; on this model the same part is model.layers.1 (@blocks.1"),
        ("llama", "transformer.h.1.attn", "the same part is model.layers.1.self_attn (@attn.1 names it"),
        ("llama", "transformer.h.0.attn.c_proj", "the same part is model.layers.0.self_attn.o_proj (@heads.0"),
        ("llama", "transformer.h.0.ln_2", "the same part is model.layers.0.post_attention_layernorm (its input is"
                                          " @mlp_in.0"),
        ("llama", "transformer.h.*.mlp", "the same parts are model.layers.0.mlp, model.layers.1.mlp (@mlp names"),
        ("gpt2", "model.layers.1.self_attn", "llama's name; on this model the same part is transformer.h.1.attn "),
        ("gpt2", "gpt_neox.layers.0.mlp", "gpt_neox's name; on this model the same part is transformer.h.0.mlp"),
        ("llama", "transformer.h.1.attn.c_attn", "transformer.h.N is gpt2's block list; sites (@resid_pre.1, @attn.1"),
    ],
)  # fmt: skip
def test_another_familys_name_is_refused_naming_the_part_here(family: str, pattern: str, says: str) -> None:
    model = build(family)
    with pytest.raises(NoMatchError) as info:
        surgery.plan(model, {"c": {"kind": "capture", "select": pattern}})
    message = str(info.value)
    assert says in message and "\n" not in message, message
    pasted = re.search(r"the same parts? (?:is|are) ([\w.]+)", message)
    if pasted:  # the name given, pasted into the recipe, plans
        assert surgery.plan(model, {"c": {"kind": "capture", "select": pasted.group(1)}}).steps[0].targets


def test_the_same_familys_names_get_no_translation() -> None:
    with pytest.raises(NoMatchError) as info:
        surgery.plan(build("gpt2"), {"c": {"kind": "capture", "select": "transformer.h.7"}})
    assert "That is" not in str(info.value) and "block list" not in str(info.value)
