"""surgery.circuit (SPEC §21) against edge patching, EAP and EAP-IG written by hand with plain hooks.

The hand references name every module themselves (no site map) and compute each edge on its own: a sender's
value from a forward hook, a receiver's gradient at a clone of its norm's input, an exact patch by a pre-hook
adding the delta to that norm's input. GPT-2 (Conv1D), a grouped-query Llama and GPT-NeoX (parallel residual).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import surgery
from surgery.core.limits import Limits, enforced
from surgery.errors import ConfigError
from surgery.safe.costs import check_circuit
from tests import arch_zoo
from tests.lm_helpers import tiny_gpt2

A, B = 3, 4  # logit_diff between these token ids at the last position
METRIC = [{"logit_diff": {"correct": A, "wrong": B}}]


def _metric(logits: torch.Tensor) -> torch.Tensor:
    z = logits[:, -1].double()
    return z[:, A] - z[:, B]


def _parts(model: Any, family: str) -> dict[str, Any]:
    """The modules of each family, by hand: blocks, attention, MLP, the two norms, the final norm, the projection."""
    if family == "gpt2":
        h = model.transformer.h
        return {"blocks": h, "attn": [b.attn for b in h], "mlp": [b.mlp for b in h], "attn_norm": [b.ln_1 for b in h],
                "mlp_norm": [b.ln_2 for b in h], "final": model.transformer.ln_f,
                "proj": [b.attn.c_proj.weight for b in h], "heads": model.config.n_head, "parallel": False}  # fmt: skip
    if family == "llama":
        h = model.model.layers
        return {"blocks": h, "attn": [b.self_attn for b in h], "mlp": [b.mlp for b in h],
                "attn_norm": [b.input_layernorm for b in h], "mlp_norm": [b.post_attention_layernorm for b in h],
                "final": model.model.norm, "proj": [b.self_attn.o_proj.weight.t() for b in h],
                "heads": model.config.num_attention_heads, "parallel": False}  # fmt: skip
    h = model.gpt_neox.layers
    return {"blocks": h, "attn": [b.attention for b in h], "mlp": [b.mlp for b in h],
            "attn_norm": [b.input_layernorm for b in h], "mlp_norm": [b.post_attention_layernorm for b in h],
            "final": model.gpt_neox.final_layer_norm, "proj": [b.attention.dense.weight.t() for b in h],
            "heads": model.config.num_attention_heads, "parallel": True}  # fmt: skip


def _first(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _senders(model: Any, p: dict[str, Any], ids: torch.Tensor, heads: bool) -> dict[str, torch.Tensor]:
    """Every sender's value on ``ids``, by name (a head: its slice of the projection's input times its rows)."""
    got: dict[str, torch.Tensor] = {}
    hooks = [p["blocks"][0].register_forward_pre_hook(lambda m, a, k: got.__setitem__("embed", _first(a, k)),
                                                      with_kwargs=True)]  # fmt: skip
    for i, (attn, mlp) in enumerate(zip(p["attn"], p["mlp"], strict=True)):
        hooks.append(attn.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(f"attn.{i}", o[0])))
        hooks.append(mlp.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(f"mlp.{i}", o)))
        proj = attn.c_proj if hasattr(attn, "c_proj") else attn.o_proj if hasattr(attn, "o_proj") else attn.dense
        hooks.append(proj.register_forward_pre_hook(lambda m, a, i=i: got.__setitem__(f"z.{i}", a[0])))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    if heads:
        n = p["heads"]
        for i, w in enumerate(p["proj"]):
            d = w.shape[0] // n
            for h in range(n):
                got[f"head.{i}.{h}"] = got[f"z.{i}"][..., h * d : (h + 1) * d] @ w[h * d : (h + 1) * d].detach()
    return got


def _edges(p: dict[str, Any], heads: bool) -> list[tuple[str, str]]:
    """Every (sender, receiver) pair by the rule of SPEC §21, written out."""
    layers, n = len(p["blocks"]), p["heads"]
    out = []
    for r in [x for i in range(layers) for x in (f"attn.{i}", f"mlp.{i}")] + ["logits"]:
        kind, at = (r.split(".")[0], int(r.split(".")[1])) if r != "logits" else ("logits", layers)
        senders = ["embed"]
        for i in range(layers):
            attn = [f"head.{i}.{h}" for h in range(n)] if heads else [f"attn.{i}"]
            if i < at or (i == at and kind == "mlp" and not p["parallel"]):
                senders += attn
            if i < at:
                senders.append(f"mlp.{i}")
        out += [(s, r) for s in senders]
    return out


def _norm(p: dict[str, Any], receiver: str) -> Any:
    if receiver == "logits":
        return p["final"]
    kind, i = receiver.split(".")
    return p[f"{kind}_norm"][int(i)]


def _hand_grads(model: Any, p: dict[str, Any], ids: torch.Tensor, point: torch.Tensor | None) -> dict[str, Any]:
    """∂Σmetric/∂(each norm's own copy of its input), with block 0's input replaced by ``point`` if given."""
    copies: dict[str, torch.Tensor] = {}
    names = [f"{k}.{i}" for i in range(len(p["blocks"])) for k in ("attn", "mlp")] + ["logits"]

    def clone(name: str, a: tuple) -> tuple:
        copies[name] = a[0].clone()
        return (copies[name], *a[1:])

    hooks = [_norm(p, name).register_forward_pre_hook(lambda m, a, name=name: clone(name, a)) for name in names]
    if point is not None:

        def start(m: Any, a: tuple, k: dict) -> Any:
            return ((point, *a[1:]), k) if a else (a, {**k, "hidden_states": point})

        hooks.append(p["blocks"][0].register_forward_pre_hook(start, with_kwargs=True))
    try:
        total = _metric(model(ids).logits).sum()
    finally:
        for h in hooks:
            h.remove()
    return dict(zip(names, torch.autograd.grad(total, [copies[n] for n in names]), strict=True))


def hand_eap(model: Any, family: str, main: torch.Tensor, src: torch.Tensor, heads: bool, steps: int | None = None):
    """Every edge's EAP (or EAP-IG) estimate per example, by name."""
    p = _parts(model, family)
    a, b = _senders(model, p, main, heads), _senders(model, p, src, heads)
    if steps is None:
        grads = _hand_grads(model, p, main, None)
    else:
        points = [(a["embed"] + (k + 0.5) / steps * (b["embed"] - a["embed"])).requires_grad_() for k in range(steps)]
        runs = [_hand_grads(model, p, main, point) for point in points]
        grads = {name: sum(r[name] for r in runs) / steps for name in runs[0]}
    return {(s, r): ((b[s] - a[s]) * grads[r]).sum(dim=(1, 2)).double() for s, r in _edges(p, heads)}


def hand_patch(model: Any, family: str, main: torch.Tensor, src: torch.Tensor, heads: bool):
    """Every edge's metric with its receiver's input alone given ``sender(source) - sender(main)``."""
    p = _parts(model, family)
    a, b = _senders(model, p, main, heads), _senders(model, p, src, heads)
    out = {}
    for s, r in _edges(p, heads):
        delta = b[s] - a[s]
        hook = _norm(p, r).register_forward_pre_hook(lambda m, x, delta=delta: (x[0] + delta, *x[1:]))
        with torch.no_grad():
            out[(s, r)] = _metric(model(main).logits)
        hook.remove()
    return out


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 60, (3, 6), generator=g)
    src = ids.clone()
    src[:, 1:3] = torch.randint(5, 60, (3, 2), generator=g)
    return {"gpt2": tiny_gpt2(64, 1), "llama": arch_zoo.build("llama"), "gpt_neox": arch_zoo.build("gpt_neox"),
            "ids": ids, "src": src}  # fmt: skip


def _by_name(result: Any) -> dict[tuple[str, str], torch.Tensor]:
    return {e: result.values["logit_diff"][i] for i, e in enumerate(result.edges)}


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
@pytest.mark.parametrize("nodes", ["blocks", "heads"])
def test_eap_equals_hand_eap_on_every_edge(models: dict[str, Any], family: str, nodes: str) -> None:
    model, ids, src = models[family], models["ids"], models["src"]
    result = surgery.circuit(model, ids, src, METRIC, method="eap", nodes=nodes)
    hand = hand_eap(model, family, ids, src, nodes == "heads")
    assert sorted(result.edges) == sorted(hand)
    with torch.no_grad():
        base = _metric(model(ids).logits)
    got = _by_name(result)
    for edge, effect in hand.items():
        torch.testing.assert_close(got[edge], base + effect, atol=1e-5, rtol=0, msg=str(edge))
    torch.testing.assert_close(result.scores["logit_diff"], result.values["logit_diff"].mean(-1) - base.mean())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eap_ig_equals_hand_eap_ig(models: dict[str, Any], family: str) -> None:
    model, ids, src = models[family], models["ids"], models["src"]
    result = surgery.circuit(model, ids, src, METRIC, method="eap_ig", steps=3, nodes="heads")
    hand = hand_eap(model, family, ids, src, True, steps=3)
    with torch.no_grad():
        base = _metric(model(ids).logits)
    got = _by_name(result)
    for edge, effect in hand.items():
        torch.testing.assert_close(got[edge], base + effect, atol=1e-5, rtol=0, msg=str(edge))


@pytest.mark.parametrize(("family", "nodes"), [("gpt2", "blocks"), ("llama", "heads"), ("gpt_neox", "heads")])
def test_exact_edges_equal_a_hand_edge_patch(models: dict[str, Any], family: str, nodes: str) -> None:
    model, ids, src = models[family], models["ids"], models["src"]
    result = surgery.circuit(model, ids, src, METRIC, method="edges", nodes=nodes, batch_edges=5)
    hand = hand_patch(model, family, ids, src, nodes == "heads")
    got = _by_name(result)
    assert sorted(got) == sorted(hand)
    for edge, value in hand.items():
        torch.testing.assert_close(got[edge], value, atol=1e-5, rtol=0, msg=str(edge))


def test_heads_are_slices_of_the_projection(models: dict[str, Any]) -> None:
    """The hand per-head slices add up to the attention output (less the bias): the reference is right."""
    model = models["llama"]
    p = _parts(model, "llama")
    got = _senders(model, p, models["ids"], True)
    total = sum(got[f"head.1.{h}"] for h in range(p["heads"]))
    torch.testing.assert_close(total, got["attn.1"], atol=1e-6, rtol=0)  # o_proj has no bias in Llama


def test_parallel_residual_has_no_attention_to_mlp_edge(models: dict[str, Any]) -> None:
    neox = surgery.circuit(models["gpt_neox"], models["ids"], models["src"], METRIC)
    gpt2 = surgery.circuit(models["gpt2"], models["ids"], models["src"], METRIC)
    assert ("attn.0", "mlp.0") not in neox.edges and ("attn.0", "mlp.1") in neox.edges
    assert ("attn.0", "mlp.0") in gpt2.edges


def test_faithfulness_ends_and_one_edge_removed(models: dict[str, Any]) -> None:
    model, ids, src = models["gpt2"], models["ids"], models["src"]
    exact = surgery.circuit(model, ids, src, METRIC, method="edges", nodes="heads")
    n = len(exact.edges)
    result = surgery.circuit(model, ids, src, METRIC, method="edges", nodes="heads", top_edges=[n, 0, n - 1])
    full, empty, all_but_one = (row["faithfulness"]["logit_diff"] for row in result.faithfulness)
    assert full == 1.0 and empty == 0.0
    with torch.no_grad():
        assert result.ends["unmodified"]["logit_diff"] == pytest.approx(float(_metric(model(ids).logits).mean()))
        # every edge patched reads the source everywhere: the source's metric
        source = float(_metric(model(src).logits).mean())
    assert result.ends["every_edge_patched"]["logit_diff"] == pytest.approx(source, abs=1e-5)
    # all edges but the last by |score|: that one edge patched alone, its exact value
    last = torch.argsort(exact.scores["logit_diff"].abs(), descending=True)[-1]
    assert result.faithfulness[2]["mean"]["logit_diff"] == pytest.approx(
        float(exact.values["logit_diff"][last].mean()), abs=1e-5)  # fmt: skip
    assert 0 < len(result.ranked(5)) == 5


def test_verify_top_and_files(models: dict[str, Any], tmp_path: Any) -> None:
    model, ids, src = models["gpt2"], models["ids"], models["src"]
    result = surgery.circuit(model, ids, src, METRIC, method="eap", nodes="heads", top_edges=[2], verify_top=4)
    exact = surgery.circuit(model, ids, src, METRIC, method="edges", nodes="heads")
    names = [f"{s} -> {r}" for s, r in exact.edges]
    for edge, value in zip(result.verify["edges"], result.verify["exact"], strict=True):
        assert value == pytest.approx(float(exact.values["logit_diff"][names.index(edge)].mean()), abs=1e-6)
    assert -1 <= result.verify["pearson"] <= 1
    data = result.to_dict()
    scores = [abs(e["score"]) for e in data["edges"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == len(result.edges)
    assert result.plot(tmp_path / "c.png").stat().st_size > 0
    assert result.plot_faithfulness(tmp_path / "f.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("name", "nodes", "says"),
    [("bert", "blocks", "bert: BertLayer"), ("mamba", "blocks", "mamba"), ("t5", "blocks", "t5"),
     ("gemma2", "heads", "Gemma2/3 norm the attention's output")],
)  # fmt: skip
def test_refused_families(name: str, nodes: str, says: str) -> None:
    model = arch_zoo.build(name)
    with pytest.raises(ConfigError, match="study\\.(method|nodes)") as e:
        surgery.circuit(model, torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), METRIC,
                        nodes=nodes)  # fmt: skip
    assert says in str(e.value) and "\n" not in str(e.value)


def test_gemma2_blocks_equal_hand_patch_of_one_edge() -> None:
    """Gemma2 writes its normed attention output: the sender is post_attention_layernorm's output."""
    model = arch_zoo.build("gemma2")
    ids = torch.randint(5, 60, (2, 5), generator=torch.Generator().manual_seed(3))
    src = ids.flip(1)
    result = surgery.circuit(model, ids, src, METRIC, method="edges")
    layer = model.model.layers[0]
    got: dict[str, torch.Tensor] = {}
    hook = layer.post_attention_layernorm.register_forward_hook(lambda m, a, o: got.__setitem__("x", o))
    with torch.no_grad():
        model(src)
        s = got["x"]
        model(ids)
        delta = s - got["x"]
    hook.remove()
    patch = model.model.norm.register_forward_pre_hook(lambda m, a: (a[0] + delta,))
    with torch.no_grad():
        want = _metric(model(ids).logits)
    patch.remove()
    torch.testing.assert_close(result.values["logit_diff"][result.edges.index(("attn.0", "logits"))], want, atol=1e-5,
                               rtol=0)  # fmt: skip


def test_options_refused_in_one_line(models: dict[str, Any]) -> None:
    model, ids, src = models["gpt2"], models["ids"], models["src"]
    cases = [({"method": "acdc"}, "study.method"), ({"method": "eap_ig"}, "study.steps"),
             ({"steps": 3}, "study.steps"), ({"top_edges": [10_000]}, "study.top_edges"),
             ({"method": "edges", "verify_top": 3}, "study.verify_top"),
             ({"nodes": "neurons"}, "study.nodes")]  # fmt: skip
    for options, key in cases:
        with pytest.raises(ConfigError, match=key):
            surgery.circuit(model, ids, src, METRIC, **options)
    with pytest.raises(ConfigError, match="rank has no gradient"):
        surgery.circuit(model, ids, src, [{"rank": {"token": 3}}])
    with enforced(Limits(count=10)), pytest.raises(ConfigError, match="study.steps: .*limits.count=20$"):
        surgery.circuit(model, ids, src, METRIC, method="eap_ig", steps=20)
    with enforced(Limits(count=1000)), pytest.raises(ConfigError, match="study.method: .*limits.count=2000$"):
        check_circuit(20_000, 100, exact=True)  # 2,000,000 patched rows: what a 20k-edge graph on 100 prompts runs
