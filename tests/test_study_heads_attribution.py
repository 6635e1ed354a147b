"""Per-head attribution (``@heads`` with ``head: {head}``) on a second architecture, a grouped-query Llama,
against attribution patching written by hand on the attention output projection's input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

import surgery  # noqa: E402

HEADS, D_HEAD = 4, 8
ACTIONS = {
    "cap": {"kind": "capture", "select": "@heads.{layer}"},
    "patch": {"kind": "modify_output", "select": "@heads.{layer}", "head": "{head}", "op": "set",
              "from": {"capture": "cap"}},
}  # fmt: skip
METRICS = [{"logit_diff": {"correct": 3, "wrong": 4}}]


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A 2-layer Llama with 4 query heads over 2 key/value heads, clean and corrupted token ids."""
    config = transformers.LlamaConfig(vocab_size=20, hidden_size=HEADS * D_HEAD, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=2,
                                      max_position_embeddings=32)  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    clean = torch.randint(5, 20, (3, 6), generator=torch.Generator().manual_seed(1))
    corrupt = clean.clone()
    corrupt[:, 2] = 5
    return model, clean, corrupt


def diff(logits: torch.Tensor) -> torch.Tensor:
    z = logits[:, -1].double()
    return z[:, 3] - z[:, 4]


def hand_atp(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor) -> torch.Tensor:
    """logit_diff plus Σ (clean - corrupted) · grad over each head's slice of o_proj's input: [layers, heads, n]."""
    projections = [layer.self_attn.o_proj for layer in model.model.layers]
    seen: dict[int, torch.Tensor] = {}
    handles = [p.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0])) for i, p in
               enumerate(projections)]  # fmt: skip
    with torch.no_grad():
        model(clean)
    source = dict(seen)
    for h in handles:
        h.remove()

    def keep(m: torch.nn.Module, a: tuple, i: int) -> None:
        a[0].retain_grad()
        seen[i] = a[0]

    handles = [p.register_forward_pre_hook(lambda m, a, i=i: keep(m, a, i)) for i, p in enumerate(projections)]
    base = diff(model(corrupt).logits)
    base.sum().backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    out = torch.empty(len(projections), HEADS, clean.shape[0], dtype=torch.float64)
    for i in range(len(projections)):
        t = seen[i].detach()
        product = (source[i] - t).double() * seen[i].grad.double()
        per_head = product.unflatten(-1, (HEADS, D_HEAD))  # [n, positions, heads, d_head]
        out[i] = base.detach() + per_head.sum(dim=(1, 3)).T
    return out


def test_per_head_attribution_on_a_grouped_query_llama_equals_atp_by_hand(llama) -> None:
    model, clean, corrupt = llama
    grid = {"layer": "0:2", "head": f"0:{HEADS}"}
    result = surgery.study(model, ACTIONS, grid, corrupt, METRICS, source=clean, method="attribution")
    assert result.values["logit_diff"].shape == (2, HEADS, 3)
    torch.testing.assert_close(result.values["logit_diff"], hand_atp(model, clean, corrupt), rtol=0, atol=1e-12)


def test_per_head_attribution_tracks_exact_per_head_patching(llama) -> None:
    """The estimate and the exact per-head patch agree in sign and order on this tiny model (correlation)."""
    model, clean, corrupt = llama
    grid = {"layer": "0:2", "head": f"0:{HEADS}"}
    exact = surgery.study(model, ACTIONS, grid, corrupt, METRICS, source=clean).mean["logit_diff"].flatten()
    atp = surgery.study(model, ACTIONS, grid, corrupt, METRICS, source=clean, method="attribution")
    estimate = atp.mean["logit_diff"].flatten()
    assert torch.corrcoef(torch.stack([exact, estimate]))[0, 1] > 0.9
