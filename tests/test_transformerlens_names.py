"""TransformerLens hook names against TransformerLens itself: a ``HookedTransformer`` built from the same GPT-2
weights (TransformerLens's own conversion, nothing folded or centred) records, at each hook point, what a capture of
that name records on the Hugging Face model; an edit through a name changes the logits as the same edit in a
TransformerLens hook does. scripts/setup installs transformer-lens (with sae-lens, the ``compare`` extra)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import surgery
from tests.arch_zoo import build

transformer_lens = pytest.importorskip("transformer_lens")

NAMES = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre", "blocks.0.hook_resid_mid",
         "blocks.1.hook_resid_post", "blocks.0.hook_attn_out", "blocks.1.hook_mlp_in", "blocks.1.hook_mlp_out",
         "blocks.0.attn.hook_z", "blocks.1.attn.hook_pattern", "ln_final.hook_normalized"]  # fmt: skip
IDS = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, Any]:
    """The tiny GPT-2 and a HookedTransformer holding its weights (no LayerNorm folding, no centring)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    hf = build("gpt2")
    c = hf.config
    cfg = HookedTransformerConfig(
        d_model=c.n_embd, d_head=c.n_embd // c.n_head, n_layers=c.n_layer, n_ctx=c.n_positions, n_heads=c.n_head,
        d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, act_fn="gelu_new", normalization_type="LN", eps=c.layer_norm_epsilon,
        original_architecture="GPT2LMHeadModel", default_prepend_bos=False, use_hook_mlp_in=True,
    )  # fmt: skip
    tl = HookedTransformer(cfg)
    tl.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                   center_unembed=False, fold_value_biases=False)  # fmt: skip
    return hf, tl.eval()


def test_the_two_models_agree(pair: tuple[torch.nn.Module, Any]) -> None:
    hf, tl = pair
    with torch.no_grad():
        torch.testing.assert_close(tl(IDS), hf(IDS).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_a_capture_of_a_hook_name_records_what_transformerlens_caches_there(
    pair: tuple[torch.nn.Module, Any], name: str
) -> None:
    hf, tl = pair
    with torch.no_grad():
        _, cache = tl.run_with_cache(IDS, names_filter=name)
        with surgery.apply(hf, {"c": {"kind": "capture", "select": name}}) as s:
            hf(IDS)
    ((module, record),) = s.captures["c"].items()
    (got,) = [x for x in (record.input, record.output) if isinstance(x, torch.Tensor)]
    assert got.shape == cache[name].shape, module  # [batch, pos, heads, d_head] for hook_z, [b, h, q, k] for patterns
    torch.testing.assert_close(got, cache[name], atol=1e-5, rtol=0)


def test_editing_through_a_hook_name_is_the_same_edit_in_transformerlens(pair: tuple[torch.nn.Module, Any]) -> None:
    """Head 1 of block 0 zeroed and a vector added to block 1's residual stream at the last position."""
    hf, tl = pair
    vector = torch.randn(hf.config.n_embd, generator=torch.Generator().manual_seed(3))

    def zero_head(z: torch.Tensor, hook: Any) -> torch.Tensor:
        return z.index_fill(2, torch.tensor([1]), 0.0)

    def add(resid: torch.Tensor, hook: Any) -> torch.Tensor:
        resid = resid.clone()
        resid[:, -1] += vector
        return resid

    recipe = {"z": {"kind": "modify_output", "select": "blocks.0.attn.hook_z", "head": 1, "op": "zero"},
              "v": {"kind": "modify_input", "select": "blocks.1.hook_resid_pre", "op": "add", "value": vector,
                    "index": "[:, -1]"}}  # fmt: skip
    with torch.no_grad():
        theirs = tl.run_with_hooks(IDS, fwd_hooks=[("blocks.0.attn.hook_z", zero_head),
                                                   ("blocks.1.hook_resid_pre", add)])  # fmt: skip
        with surgery.apply(hf, recipe):
            ours = hf(IDS).logits
        unchanged = hf(IDS).logits
    assert (theirs - unchanged).abs().max() > 0.01  # the edits count
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
