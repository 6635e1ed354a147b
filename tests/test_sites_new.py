"""@attn_in, @mlp_in, @unembed_in, @attn_pattern and the TransformerLens hook names, against plain PyTorch hooks on
module names written here by hand (tiny models built from configs, offline)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import surgery  # noqa: E402
from surgery.errors import ConfigError  # noqa: E402
from tests.arch_zoo import build, example  # noqa: E402
from tests.conftest import Snapshot  # noqa: E402

# block {}'s norms read by the attention and the MLP, and the final norm: by hand from each module tree
NORMS = {
    "gpt2": ("transformer.h.{}.ln_1", "transformer.h.{}.ln_2", "transformer.ln_f"),
    "llama": ("model.layers.{}.input_layernorm", "model.layers.{}.post_attention_layernorm", "model.norm"),
    "gemma2": ("model.layers.{}.input_layernorm", "model.layers.{}.pre_feedforward_layernorm", "model.norm"),
    "gpt_neox": ("gpt_neox.layers.{}.input_layernorm", "gpt_neox.layers.{}.post_attention_layernorm",
                 "gpt_neox.final_layer_norm"),
    "opt": ("model.decoder.layers.{}.self_attn_layer_norm", "model.decoder.layers.{}.final_layer_norm",
            "model.decoder.final_layer_norm"),
    "phi3": ("model.layers.{}.input_layernorm", "model.layers.{}.post_attention_layernorm", "model.norm"),
    "t5": ("decoder.block.{}.layer.0.layer_norm", "decoder.block.{}.layer.2.layer_norm", "decoder.final_layer_norm"),
    "vit": ("vit.layers.{}.layernorm_before", "vit.layers.{}.layernorm_after", None),
}  # fmt: skip
BRANCH = {"attn_in": 0, "mlp_in": 1, "unembed_in": 2}
ATTENTION = {  # block {}'s attention module (its output item 1 holds eager attention's probabilities; T5: item 2)
    "gpt2": "transformer.h.{}.attn", "gpt_neox": "gpt_neox.layers.{}.attention",
    "opt": "model.decoder.layers.{}.self_attn", "bert": "bert.encoder.layer.{}.attention.self",
    "vit": "vit.layers.{}.attention", "t5": "decoder.block.{}.layer.0.SelfAttention",
    **{f: "model.layers.{}.self_attn" for f in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3",
                                                 "mixtral")},
}  # fmt: skip
_MODELS: dict[str, nn.Module] = {}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """One thread (tiny matmuls on a busy machine) and no transformers config chatter."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)
    torch.set_num_threads(threads)


def model_of(name: str) -> nn.Module:
    """The tiny model ``name``, built once (every test leaves it as it was)."""
    if name not in _MODELS:
        _MODELS[name] = build(name)
    return _MODELS[name]


def run(model: nn.Module, name: str, **extra: Any) -> Any:
    with torch.no_grad():
        return model(**example(name), **extra)


def names_of(name: str, site: str, blocks: tuple[int, ...] = (0, 1)) -> list[str]:
    pattern = NORMS[name][BRANCH[site]]
    assert pattern is not None
    if site == "unembed_in":
        return [pattern]
    found = [pattern.format(i) for i in blocks]
    if name == "t5":  # both stacks, the encoder's first (its MLP norm is layer.1's)
        found = [p.replace("decoder", "encoder").replace("layer.2", "layer.1") for p in found] + found
    return found


# ---------------------------------------------------------------- @attn_in, @mlp_in, @unembed_in

BRANCH_CASES = [(n, s) for n in NORMS for s in BRANCH if NORMS[n][BRANCH[s]] is not None]


@pytest.mark.parametrize(("name", "site"), BRANCH_CASES)
def test_a_branch_input_is_what_a_pre_hook_on_its_norm_sees_and_changes(name: str, site: str) -> None:
    model = model_of(name)
    names = names_of(name, site)
    plan = surgery.plan(model, {"c": {"kind": "capture", "select": f"@{site}"}})
    assert plan.to_dict()[0]["matched"] == names
    seen: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: seen.update({n: a[0]}))
               for n in names]  # fmt: skip
    try:
        with surgery.apply(model, plan) as s:
            run(model, name)
            records = s.captures["c"]
    finally:
        for h in handles:
            h.remove()
    assert sorted(records) == sorted(names)
    for n in names:
        assert torch.equal(records[n].input, seen[n])

    # a change: the same op by a hand-written pre-hook on the norm, bit for bit
    before = Snapshot.of(model)
    with surgery.apply(model, {"e": {"kind": "modify_input", "select": f"@{site}", "op": "add", "value": 0.5}}):
        changed = run(model, name).logits
    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda m, a: (a[0] + 0.5, *a[1:])) for n in names]
    by_hand = run(model, name).logits
    for h in hooks:
        h.remove()
    assert torch.equal(changed, by_hand) and not torch.equal(changed, run(model, name).logits)
    before.assert_same(model)


def _mlp_branch(name: str, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What block ``block``'s MLP branch adds to the stream ``x`` reads, written out by hand."""
    if name == "gpt2":
        return block.mlp(block.ln_2(x))
    if name == "gemma2":
        return block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(x)))
    if name == "gpt_neox":
        return block.mlp(block.post_attention_layernorm(x))
    return block.mlp(block.post_attention_layernorm(x))


BLOCKS = {"gpt2": "transformer.h.{}", "llama": "model.layers.{}", "gemma2": "model.layers.{}",
          "gpt_neox": "gpt_neox.layers.{}"}  # fmt: skip


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2", "gpt_neox"])
def test_an_edit_at_mlp_in_reaches_the_mlp_branch_only(name: str) -> None:
    """Block 1 leaves resid_mid + mlp(norm(resid_mid + delta)): the stream itself carries resid_mid on unchanged."""
    model = model_of(name)
    if name == "gpt_neox":  # sequential residual: the MLP reads resid_mid (parallel is tested by the hook test)
        model = build("gpt_neox")
        model.config.use_parallel_residual = False
        for layer in model.gpt_neox.layers:
            layer.use_parallel_residual = False
    assert name != "llama" or model.config.num_key_value_heads < model.config.num_attention_heads
    block = model.get_submodule(BLOCKS[name].format(1))
    norm = model.get_submodule(NORMS[name][1].format(1))
    delta = torch.zeros(model.config.hidden_size)
    delta[:4] = 0.5  # a shift a LayerNorm does not take away
    got: dict[str, Any] = {}
    handles = [
        norm.register_forward_pre_hook(lambda m, a: got.update(mid=a[0]), prepend=True),  # before surgery's hook
        block.register_forward_hook(lambda m, a, o: got.update(out=o[0] if isinstance(o, tuple) else o)),
        model.get_submodule(ATTENTION.get(name, "gpt_neox.layers.{}.attention").format(1)).register_forward_hook(
            lambda m, a, o: got.update(attn=o[0])
        ),
    ]
    clean_attn = None
    try:
        run(model, name)
        clean_attn = got["attn"]
        with surgery.apply(model, {"e": {"kind": "modify_output", "select": "@mlp_in.1", "op": "add", "value": 0.5,
                                         "index": "[..., :4]"}}):  # fmt: skip
            edited = run(model, name).logits
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        expected = got["mid"] + _mlp_branch(name, block, got["mid"] + delta)
    assert torch.equal(got["out"], expected)
    assert torch.equal(got["attn"], clean_attn)  # the attention branch of that block is untouched

    hook = norm.register_forward_pre_hook(lambda m, a: (a[0] + delta,))  # the same edit by hand
    by_hand = run(model, name).logits
    hook.remove()
    assert torch.equal(edited, by_hand)


def test_an_edit_at_attn_in_equals_a_pre_hook_on_the_attention_norm_of_a_grouped_query_llama() -> None:
    model = model_of("llama")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    with surgery.apply(model, {"e": {"kind": "modify_input", "select": "@attn_in.0", "op": "zero"}}):
        edited = run(model, "llama").logits
    hook = model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),))
    by_hand = run(model, "llama").logits
    hook.remove()
    assert torch.equal(edited, by_hand)


def test_unembed_in_is_the_final_norms_input_and_the_decoders_only_on_t5() -> None:
    t5 = model_of("t5")
    assert surgery.plan(t5, {"c": {"kind": "capture", "select": "@unembed_in"}}).to_dict()[0]["matched"] == [
        "decoder.final_layer_norm"
    ]
    model = model_of("gpt2")
    seen: list[torch.Tensor] = []
    h = model.transformer.ln_f.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with surgery.apply(model, {"c": {"kind": "capture", "select": "@unembed_in"}}) as s:
        run(model, "gpt2")
    h.remove()
    assert torch.equal(s.captures["c"]["transformer.ln_f"].input, seen[0])
    with pytest.raises(ConfigError, match=r"^actions\.c\.select: @unembed_in is one module for the model"):
        surgery.plan(model, {"c": {"kind": "capture", "select": "@unembed_in.0"}})


@pytest.mark.parametrize(
    ("name", "site", "why"),
    [
        ("bert", "attn_in", "(bert: BertLayer): BERT blocks are post-norm: each branch reads the residual stream"),
        ("bert", "mlp_in", "(bert: BertLayer): BERT blocks are post-norm"),
        ("bert", "unembed_in", "(bert: BertLayer): BERT blocks are post-norm: there is no final norm"),
        ("mamba", "attn_in", "(mamba: MambaBlock): Mamba blocks have no attention and no MLP"),
        ("mamba", "attn_pattern", "(mamba: MambaBlock): Mamba blocks have no attention and no MLP"),
        ("vit", "unembed_in", "(vit: ViTLayer): a vision classifier has no unembedding"),
    ],
)
def test_a_family_without_the_branch_site_is_refused_in_one_line_naming_it(name: str, site: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        surgery.plan(model_of(name), {"a": {"kind": "modify_input", "select": f"@{site}", "op": "zero"}})
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"actions.a.select: @{site}") and why in text


def test_post_norm_opt_refuses_the_branch_inputs() -> None:
    import transformers

    config = transformers.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=32,
                                    do_layer_norm_before=False)  # fmt: skip
    model = transformers.OPTForCausalLM(config).eval()
    for site in ("attn_in", "mlp_in"):
        with pytest.raises(ConfigError, match=rf"^actions\.a\.select: @{site} does not exist .*post-norm blocks"):
            surgery.plan(model, {"a": {"kind": "capture", "select": f"@{site}"}})


# ---------------------------------------------------------------- @attn_pattern

DECODERS = ["gpt2", "gpt_neox", "opt", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral"]


@pytest.mark.parametrize("name", [*DECODERS, "bert", "vit", "t5"])
def test_attn_pattern_is_what_output_attentions_returns_bit_for_bit(name: str) -> None:
    model = model_of(name)
    with surgery.apply(model, {"p": {"kind": "capture", "select": "@attn_pattern"}}) as s:
        out = run(model, name, output_attentions=True)
    records = s.captures["p"]
    if name == "t5":
        expected = [*out.encoder_attentions, *out.decoder_attentions]
        modules = [f"{stack}.block.{i}.layer.0.SelfAttention" for stack in ("encoder", "decoder") for i in (0, 1)]
    else:
        expected, modules = list(out.attentions), [ATTENTION[name].format(i) for i in (0, 1)]
    assert list(records) == modules
    for module, probabilities in zip(modules, expected, strict=True):
        got = records[module].output
        assert got.shape == probabilities.shape and got.dim() == 4  # [batch, heads, query, key]
        assert torch.equal(got, probabilities)
    if name in DECODERS:
        assert torch.allclose(got.sum(-1), torch.ones(())) and got[..., 0, 1:].abs().sum() == 0  # causal


def test_attn_pattern_of_the_shipped_induction_model() -> None:
    from surgery.models.induction import induction_lm, repeated_sequences

    model = induction_lm()
    ids, mask, _ = repeated_sequences(2, torch.Generator().manual_seed(0))
    with surgery.apply(model, {"p": {"kind": "capture", "select": "@attn_pattern.1", "head": 0}}) as s:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert torch.equal(s.captures["p"]["model.layers.1.self_attn"].output, out.attentions[1][:, 0])


@contextmanager
def softmax_edited(model: nn.Module, attention: str, change: Any) -> Iterator[None]:
    """By hand: while ``attention`` runs, torch.nn.functional.softmax's result goes through ``change``."""
    original = torch.nn.functional.softmax
    active: list[bool] = []

    def softmax(*args: Any, **kwargs: Any) -> torch.Tensor:
        result = original(*args, **kwargs)
        return change(result) if active else result

    module = model.get_submodule(attention)
    handles = [module.register_forward_pre_hook(lambda m, a: active.append(True)),
               module.register_forward_hook(lambda m, a, o: active.clear())]  # fmt: skip
    try:
        with mock.patch.object(torch.nn.functional, "softmax", softmax):
            yield
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2", "opt"])
def test_zeroing_one_heads_pattern_row_equals_editing_softmax_by_hand(name: str) -> None:
    model = model_of(name)
    before = Snapshot.of(model)
    clean = run(model, name).logits

    def zero(p: torch.Tensor) -> torch.Tensor:
        p = p.clone()
        p[:, 2, -1] = 0
        return p

    action = {"kind": "modify_output", "select": "@attn_pattern.1", "op": "zero", "index": "[:, 2, -1]"}
    with surgery.apply(model, {"z": action, "p": {"kind": "capture", "select": "@attn_pattern.1"}}) as s:
        edited = run(model, name).logits
    with softmax_edited(model, ATTENTION[name].format(1), zero):
        by_hand = run(model, name).logits
    assert torch.equal(edited, by_hand) and not torch.equal(edited, clean)
    pattern = s.captures["p"][ATTENTION[name].format(1)].output
    assert pattern[:, 2, -1].abs().sum() == 0 and pattern[:, 1, -1].abs().sum() > 0  # the capture sees the change
    before.assert_same(model) and torch.equal(run(model, name).logits, clean)


def test_attn_with_function_softmax_records_the_pattern_too() -> None:
    model = model_of("llama")
    actions = {"f": {"kind": "capture", "select": "@attn.0", "function": "softmax"},
               "p": {"kind": "capture", "select": "@attn_pattern.0"}}  # fmt: skip
    with surgery.apply(model, actions) as s:
        run(model, "llama")
    name = "model.layers.0.self_attn"
    assert torch.equal(s.captures["f"][name].output, s.captures["p"][name].output)


def test_a_fused_attention_kernel_is_refused_naming_the_override_then_eager_works() -> None:
    model = build("llama")
    model.set_attn_implementation("sdpa")
    with pytest.raises(ConfigError) as e:
        surgery.plan(model, {"p": {"kind": "capture", "select": "@attn_pattern"}})
    assert str(e.value) == (
        "actions.p.select: @attn_pattern needs eager attention: model.layers.0.self_attn runs 'sdpa', which never"
        " materialises the probabilities; load it with model.attn_implementation=eager (Python:"
        " model.set_attn_implementation('eager'))"
    )
    model.set_attn_implementation("eager")
    with surgery.apply(model, {"p": {"kind": "capture", "select": "@attn_pattern.0"}}) as s:
        out = run(model, "llama", output_attentions=True)
    assert torch.equal(s.captures["p"]["model.layers.0.self_attn"].output, out.attentions[0])


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ({"kind": "modify_input", "op": "zero"}, "actions.a.kind: @attn_pattern is computed inside the attention's"),
        ({"kind": "capture", "what": ["input"]}, "actions.a.what: @attn_pattern sets what to ['output'] for you"),
        ({"kind": "capture", "lens": "logit"}, "actions.a.lens: reads a site's output"),
        ({"kind": "capture", "function": "softmax"}, "actions.a.function: @attn_pattern reads the probabilities"),
        ({"kind": "modify_output", "op": "set", "from": {"capture": "c"}}, "actions.a.from: a patch of @attn_pattern"),
        ({"kind": "capture", "head": 9}, "actions.a.head: head 9 does not exist"),
        ({"kind": "capture", "head": 1, "index": "[:, 1]"}, "actions.a.index: with head, @attn_pattern takes"),
    ],
)
def test_what_attn_pattern_cannot_do_is_one_line(action: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        surgery.plan(model_of("gpt2"), {"a": {**action, "select": "@attn_pattern"}})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# ---------------------------------------------------------------- TransformerLens hook names

TL_NAMES = [
    ("blocks.1.hook_resid_pre", "@resid_pre.1"), ("blocks.0.hook_resid_mid", "@resid_mid.0"),
    ("blocks.1.hook_resid_post", "@resid_post.1"), ("blocks.0.hook_attn_out", "@attn_out.0"),
    ("blocks.1.hook_mlp_out", "@mlp_out.1"), ("blocks.1.hook_mlp_in", "@mlp_in.1"),
    ("blocks.0.attn.hook_z", "@heads.0"), ("blocks.1.attn.hook_pattern", "@attn_pattern.1"),
    ("ln_final.hook_normalized", "@final_norm"), ("hook_embed", "@embed"), ("blocks.*.hook_resid_pre", "@resid_pre"),
]  # fmt: skip


def _captured(model: nn.Module, name: str, select: Any) -> dict[str, Any]:
    with surgery.apply(model, {"c": {"kind": "capture", "select": select}}) as s:
        run(model, name)
    return {k: (r.input, r.output) for k, r in s.captures["c"].items()}


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2"])
def test_transformerlens_names_capture_what_their_sites_do(name: str) -> None:
    model = model_of(name)
    for tl, site in TL_NAMES:
        plan_tl = surgery.plan(model, {"c": {"kind": "capture", "select": tl}}).to_dict()[0]
        plan_site = surgery.plan(model, {"c": {"kind": "capture", "select": site}}).to_dict()[0]
        assert plan_tl == plan_site, tl
        got, want = _captured(model, name, tl), _captured(model, name, site)
        assert list(got) == list(want) and got, tl
        for key in got:
            assert all(_same(a, b) for a, b in zip(got[key], want[key], strict=True)), (tl, key)
    pair = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]
    both = surgery.plan(model, {"c": {"kind": "capture", "select": pair}}).to_dict()[0]["matched"]
    assert both == surgery.plan(model, {"c": {"kind": "capture", "select": "@resid_pre"}}).to_dict()[0]["matched"]


def _same(a: Any, b: Any) -> bool:
    """Two recorded values (None, a tensor, or a tuple of them) equal bit for bit."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is None and b is None


def test_a_transformerlens_name_on_a_model_that_lacks_the_site_says_which_site_it_is() -> None:
    with pytest.raises(ConfigError) as e:
        surgery.plan(model_of("gpt_neox"), {"a": {"kind": "capture", "select": "blocks.0.hook_resid_mid"}})
    assert str(e.value).startswith("actions.a.select: @resid_mid does not exist on this model (gpt_neox:")
    assert str(e.value).endswith("(TransformerLens name: blocks.0.hook_resid_mid is @resid_mid.0)")


class _Hook(nn.Identity):
    pass


class _TLLike(nn.Module):
    """A model with real modules named like TransformerLens hook points."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_embed = _Hook()
        self.blocks = nn.ModuleList(nn.ModuleDict({"hook_resid_pre": _Hook(), "lin": nn.Linear(4, 4)}) for _ in "ab")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_embed(x)
        for block in self.blocks:
            x = block["lin"](block["hook_resid_pre"](x))
        return x


def test_a_real_module_named_like_a_transformerlens_hook_wins() -> None:
    model = _TLLike()
    for select, matched in (
        ("blocks.1.hook_resid_pre", ["blocks.1.hook_resid_pre"]),
        ("hook_embed", ["hook_embed"]),
        ("blocks.*.hook_resid_pre", ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]),
    ):
        plan = surgery.plan(model, {"c": {"kind": "capture", "select": select}})
        assert plan.to_dict()[0]["matched"] == matched


def test_a_study_over_transformerlens_names_equals_the_one_over_sites() -> None:
    model = model_of("llama")
    clean, corrupt = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[5, 6, 7, 8, 10]])
    metrics = [{"logit_diff": {"correct": 3, "wrong": 4}}]

    def actions(select: str) -> dict[str, Any]:
        return {"cap": {"kind": "capture", "select": select},
                "patch": {"kind": "modify_input", "select": select, "op": "set", "index": "[:, {pos}]",
                          "from": {"capture": "cap"}}}  # fmt: skip

    grid = {"layer": "0:2", "pos": "0:5"}
    a = surgery.study(model, actions("blocks.{layer}.hook_resid_pre"), grid, corrupt, metrics, source=clean)
    b = surgery.study(model, actions("@resid_pre.{layer}"), grid, corrupt, metrics, source=clean)
    assert torch.equal(a.values["logit_diff"], b.values["logit_diff"]) and a.values["logit_diff"].abs().sum() > 0


def test_the_site_map_lists_the_new_sites() -> None:
    from surgery.arch import site_map

    table = site_map(model_of("llama")).table()
    assert "@attn_in       model.layers.0.input_layernorm … model.layers.1.input_layernorm (2)  [input]" in table
    assert "@attn_pattern  model.layers.0.self_attn … model.layers.1.self_attn (2)  [output item 1:" in table
    assert "@unembed_in    model.norm  [input]" in table


def test_the_induction_model_from_the_cli_job_captures_and_plots_its_patterns(tmp_path: Path) -> None:
    """``+model=induction_lm`` as shipped: ``plot: true`` on @attn_pattern draws the heads; a TL name is its site."""
    from safetensors.torch import load_file

    from surgery.app.job import run_job
    from tests.test_cli import composed

    out = tmp_path / "run"
    run_job(composed("+model=induction_lm", "+actions.p={kind:capture,select:'@attn_pattern.1',plot:true}",
                     "+actions.t={kind:capture,select:'blocks.0.hook_resid_post'}"), out)  # fmt: skip
    assert (out / "plots" / "p__model.layers.1.self_attn__output.png").stat().st_size > 0
    saved = load_file(str(out / "captures.safetensors"))
    pattern = next(v for k, v in saved.items() if k.startswith("p/model.layers.1.self_attn/output"))
    assert pattern.shape[:2] == (1, 4) and torch.allclose(pattern.sum(-1), torch.ones(()))
    assert any(k.startswith("t/model.layers.0/output") for k in saved)


def test_a_logit_lens_on_a_transformerlens_name_reads_its_site() -> None:
    model = model_of("gpt2")
    actions = {"l": {"kind": "capture", "select": "blocks.1.hook_resid_post", "lens": "logit"}}
    with surgery.apply(model, actions) as s:  # @resid_post.1 of the last block through the lens: the logits
        logits = run(model, "gpt2").logits
    assert torch.equal(s.captures["l"]["transformer.h.1"].output, logits)
