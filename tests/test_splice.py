"""kind: splice on a tiny GPT-2: every SAE architecture, the error term, feature edits, transcoders, captured features,
several SAEs in one plan and a study grid, each against the same SAE written by hand in plain PyTorch (bit for bit);
and bad input refused before the model is touched."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import surgery
from surgery.errors import ConfigError
from tests.conftest import Snapshot
from tests.splice_helpers import hand_decode, hand_encode, sae_tensors, write_plain, write_saelens

D, S = 32, 64  # the tiny GPT-2's width, and the SAEs' number of features
SITE = "transformer.h.1"


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lm(tiny_lm: Any) -> tuple[Any, torch.Tensor]:
    model, clean, _ = tiny_lm
    return model, clean


def logits_with_hook(model: Any, ids: torch.Tensor, module: str, hook: Any, pre: bool = False) -> torch.Tensor:
    """The model's logits with a hand-written hook on ``module``."""
    m = model.get_submodule(module)
    handle = m.register_forward_pre_hook(hook) if pre else m.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        handle.remove()


def spliced_logits(model: Any, ids: torch.Tensor, action: dict, name: str = "sae") -> tuple[torch.Tensor, Any]:
    with torch.no_grad(), surgery.apply(model, {name: action}) as s:
        return model(ids).logits, s.captures.get(name, {})


ARCHS = [
    ("standard", {}, {}),
    ("jumprelu", {}, {}),
    ("topk", {"k": 5}, {"k": 5}),
    ("topk", {"k": 5, "rescale_acts_by_decoder_norm": True}, {"k": 5, "rescale": True}),
    ("standard", {"apply_b_dec_to_input": False}, {"b_dec_in": False}),
    ("standard", {"normalize_activations": "constant_norm_rescale"}, {"normalize": "constant_norm_rescale"}),
    ("jumprelu", {"normalize_activations": "layer_norm"}, {"normalize": "layer_norm"}),
]


@pytest.mark.parametrize(("arch", "cfg", "hand"), ARCHS, ids=[f"{a}-{'-'.join(c) or 'plain'}" for a, c, _ in ARCHS])
def test_each_saelens_architecture_equals_the_hand_written_hook(lm, tmp_path: Path, arch, cfg, hand) -> None:
    model, ids = lm
    t = sae_tensors(D, S, threshold=arch == "jumprelu")
    write_saelens(tmp_path / "sae", t, architecture=arch, **cfg)
    before = Snapshot.of(model)
    got, caps = spliced_logits(model, ids, {"kind": "splice", "select": SITE, "module": {"path": str(tmp_path / "sae")},
                                            "capture": True})  # fmt: skip
    before.assert_same(model)
    seen = {}

    def hook(m, a, o):
        f, state = hand_encode(t, o, arch, **{k: v for k, v in hand.items()})
        seen["f"] = f
        return hand_decode(t, f, state, hand.get("normalize", "none"), hand.get("rescale", False))

    assert torch.equal(got, logits_with_hook(model, ids, SITE, hook))
    assert torch.equal(caps[SITE].features, seen["f"])
    assert 0 < (seen["f"] > 0).float().sum(-1).mean() < S  # a sparse code: some features on, not all


def test_a_plain_safetensors_file_with_each_activation(lm, tmp_path: Path) -> None:
    model, ids = lm
    for activation, extra in (("relu", {}), ("jumprelu", {}), ("topk", {"k": 7})):
        t = sae_tensors(D, S, seed=3, threshold=activation == "jumprelu")
        path = write_plain(tmp_path / f"{activation}.safetensors", t)
        got, _ = spliced_logits(model, ids, {"kind": "splice", "select": SITE, "module": {"path": str(path)},
                                             "activation": activation, **extra})  # fmt: skip
        arch = {"relu": "standard"}.get(activation, activation)
        hook = lambda m, a, o, t=t, arch=arch, extra=extra: hand_decode(t, hand_encode(t, o, arch, **extra)[0])  # noqa: E731
        want = logits_with_hook(model, ids, SITE, hook)
        assert torch.equal(got, want), activation


def test_error_term_adds_back_what_the_sae_misses(lm, tmp_path: Path) -> None:
    model, ids = lm
    t = sae_tensors(D, S)
    path = write_plain(tmp_path / "sae.safetensors", t)
    got, _ = spliced_logits(model, ids, {"kind": "splice", "select": SITE, "module": {"path": str(path)},
                                         "error_term": True})  # fmt: skip

    def hook(m, a, o):
        recon = hand_decode(t, hand_encode(t, o)[0])
        return recon + (o - recon)

    assert torch.equal(got, logits_with_hook(model, ids, SITE, hook))
    with torch.no_grad():
        clean = model(ids).logits
    torch.testing.assert_close(got, clean)  # the model computes what it did (up to rounding)
    spliced_only, _ = spliced_logits(model, ids, {"kind": "splice", "select": SITE, "module": {"path": str(path)}})
    assert not torch.allclose(spliced_only, clean, atol=1e-3)  # the SAE alone does change it


@pytest.mark.parametrize(
    ("features", "edit"),
    [
        ({"index": [12, 40], "op": "zero"}, lambda f: f.index_fill(-1, torch.tensor([12, 40]), 0.0)),
        ({"index": 3, "op": "set", "value": 2.5}, lambda f: f.index_fill(-1, torch.tensor([3]), 2.5)),
        ({"index": [1, 2], "op": "mul", "value": [3.0, 0.5]}, None),
        ({"index": [5], "op": "add", "value": 1.0}, None),
    ],
    ids=["zero", "set", "mul", "add"],
)
def test_feature_edits_with_the_error_term(lm, tmp_path: Path, features, edit) -> None:
    model, ids = lm
    t = sae_tensors(D, S)
    path = write_plain(tmp_path / "sae.safetensors", t)
    got, caps = spliced_logits(model, ids, {"kind": "splice", "select": SITE, "module": {"path": str(path)},
                                            "error_term": True, "capture": True, "features": features})  # fmt: skip

    def hand_edit(f):
        if edit is not None:
            return edit(f)
        g = f.clone()
        idx = features["index"] if isinstance(features["index"], list) else [features["index"]]
        val = torch.tensor(features["value"]) if isinstance(features["value"], list) else features["value"]
        g[..., idx] = f[..., idx] * val if features["op"] == "mul" else f[..., idx] + val
        return g

    seen = {}

    def hook(m, a, o):
        f, _ = hand_encode(t, o)
        seen["f"] = f
        return hand_decode(t, hand_edit(f)) + (o - hand_decode(t, f))

    assert torch.equal(got, logits_with_hook(model, ids, SITE, hook))
    assert torch.equal(caps[SITE].features, seen["f"])  # features as encoded, before the edit


def test_a_transcoder_reads_the_mlp_input_and_replaces_its_output(lm, tmp_path: Path) -> None:
    model, ids = lm
    t = sae_tensors(D, S, seed=5)
    write_saelens(tmp_path / "tc", t, architecture="transcoder", d_out=D, apply_b_dec_to_input=False)
    mlp = "transformer.h.0.mlp"
    got, _ = spliced_logits(model, ids, {"kind": "splice", "select": mlp, "read": "input", "at": "output",
                                         "module": {"path": str(tmp_path / "tc")}, "error_term": True})  # fmt: skip

    def hook(m, a, o):
        recon = hand_decode(t, hand_encode(t, a[0], b_dec_in=False)[0])
        return recon + (o - recon)

    assert torch.equal(got, logits_with_hook(model, ids, mlp, hook))


def test_at_input_replaces_what_the_module_receives(lm, tmp_path: Path) -> None:
    model, ids = lm
    t = sae_tensors(D, S, seed=6)
    path = write_plain(tmp_path / "sae.safetensors", t)
    got, _ = spliced_logits(model, ids, {"kind": "splice", "select": "transformer.ln_f", "at": "input",
                                         "module": {"path": str(path)}})  # fmt: skip
    want = logits_with_hook(
        model, ids, "transformer.ln_f", lambda m, a: (hand_decode(t, hand_encode(t, a[0])[0]),), pre=True
    )
    assert torch.equal(got, want)


def test_features_top_keeps_k_values_and_indices_and_flattens_into_captures(lm, tmp_path: Path) -> None:
    model, ids = lm
    t = sae_tensors(D, S)
    path = write_plain(tmp_path / "sae.safetensors", t)
    with torch.no_grad(), surgery.apply(model, {"sae": {"kind": "splice", "select": SITE, "module": {"path": str(path)},
                                                        "capture": True, "features_top": 4}}) as s:  # fmt: skip
        model(ids)
        model(ids)
        top = s.captures["sae"][SITE].features
        from surgery.core.records import flatten_captures

        flat = flatten_captures(s.captures)
    seen = {}
    logits_with_hook(model, ids, SITE, lambda m, a, o: seen.update(f=hand_encode(t, o)[0]))
    full = seen["f"]
    values, indices = full.topk(4, dim=-1)
    assert torch.equal(top["values"], values) and torch.equal(top["indices"], indices)
    assert sorted(flat) == [f"sae/{SITE}/features.indices/0", f"sae/{SITE}/features.indices/1",
                            f"sae/{SITE}/features.values/0", f"sae/{SITE}/features.values/1"]  # fmt: skip


def test_one_sae_per_block_by_name_or_by_list(lm, tmp_path: Path) -> None:
    model, ids = lm
    tensors = {}
    for i in range(2):
        tensors[i] = sae_tensors(D, S, seed=10 + i)
        write_saelens(tmp_path / "saes" / f"transformer.h.{i}", tensors[i])
    by_name = {"kind": "splice", "select": "transformer.h.*", "module": {"path": str(tmp_path / "saes" / "{name}")},
               "capture": True}  # fmt: skip
    got, caps = spliced_logits(model, ids, by_name)
    handles = [model.transformer.h[i].register_forward_hook(
        lambda m, a, o, t=tensors[i]: hand_decode(t, hand_encode(t, o)[0])) for i in range(2)]  # fmt: skip
    with torch.no_grad():
        want = model(ids).logits
    for h in handles:
        h.remove()
    assert torch.equal(got, want)
    assert sorted(caps) == ["transformer.h.0", "transformer.h.1"]
    listed = {**by_name, "module": {"path": [str(tmp_path / "saes" / f"transformer.h.{i}") for i in range(2)]}}
    assert torch.equal(spliced_logits(model, ids, listed)[0], want)
    with pytest.raises(ConfigError, match=r"actions.sae.module.path: 1 paths for 2 selected modules"):
        surgery.plan(model, {"sae": {**by_name, "module": {"path": [str(tmp_path / "saes" / "transformer.h.0")]}}})


def test_a_feature_ablation_grid_in_a_study(lm, tmp_path: Path) -> None:
    model, ids = lm
    t = sae_tensors(D, S)
    path = write_plain(tmp_path / "sae.safetensors", t)
    actions = {"sae": {"kind": "splice", "select": SITE, "module": {"path": str(path)}, "error_term": True,
                       "features": {"index": "{feature}", "op": "zero"}}}  # fmt: skip
    result = surgery.study(model, actions, {"feature": "0:4"}, ids, [{"logit": {"token": 3}}])
    for f in range(4):

        def hook(m, a, o, f=f):
            acts = hand_encode(t, o)[0]
            edited = acts.clone()
            edited[..., f] = 0
            return hand_decode(t, edited) + (o - hand_decode(t, acts))

        want = logits_with_hook(model, ids, SITE, hook)[:, -1, 3]
        assert torch.equal(result.values["logit"][f].float(), want), f


def test_the_plan_checks_widths_and_remove_restores_the_model(lm, tmp_path: Path) -> None:
    model, ids = lm
    wide = write_plain(tmp_path / "wide.safetensors", sae_tensors(D + 8, S))
    before = Snapshot.of(model)
    with pytest.raises(ConfigError) as info:  # a repeated block: the residual stream is the config's n_embd wide
        surgery.plan(model, {"sae": {"kind": "splice", "select": SITE, "module": {"path": str(wide)}}})
    assert str(info.value) == (
        f"actions.sae.module.path: W_enc in {str(wide)!r} is [40, 64] (d_in 40), but the output of {SITE!r} is 32"
        " wide (the model's config (a repeated block: the residual stream))"
    )
    with pytest.raises(ConfigError, match=r"the output of 'transformer.h.0.attn' is 32 wide \(on this input\)"):
        surgery.plan(model, {"sae": {"kind": "splice", "select": "transformer.h.0.attn", "item": 0,
                                     "module": {"path": str(wide)}}}, example_inputs=(ids,))  # fmt: skip
    with pytest.raises(ConfigError, match=r"is \[40, 64\] \(d_in 40\), but the input of 'transformer.h.0.mlp.c_fc'"):
        surgery.plan(model, {"sae": {"kind": "splice", "select": "transformer.h.0.mlp.c_fc", "read": "input",
                                     "module": {"path": str(wide)}}})  # fmt: skip
    before.assert_same(model)


BAD = [
    ("no_cfg", "actions.sae.module.path: the directory {dir!r} has no cfg.json; a SAELens SAE directory holds cfg.json"
               " and sae_weights.safetensors (what SAE.save_model writes)"),
    ("unknown_arch", "actions.sae.module.path: {cfg!r} has architecture 'gated', which splice does not run; it runs"
                     " standard, jumprelu, topk, transcoder, skip_transcoder, jumprelu_transcoder,"
                     " jumprelu_skip_transcoder"),
    ("index", "actions.sae.features.index: 64 is beyond the 64 features of {dir!r} (indices run 0..63)"),
    ("missing_tensor", "actions.sae.module.path: {weights!r} has no tensor 'threshold' (a JumpReLU SAE needs its"
                       " threshold); it has W_dec, W_enc, b_dec, b_enc"),
    ("bad_shape", "actions.sae.module.path: b_enc in {weights!r} has shape [63], but W_enc [32, 64] (d_in 32, d_sae 64)"
                  " needs [64]"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "message"), BAD, ids=[c for c, _ in BAD])
def test_bad_input_is_one_line_naming_the_file_and_tensor(lm, tmp_path: Path, case: str, message: str) -> None:
    model, _ = lm
    t = sae_tensors(D, S)
    directory = tmp_path / "sae"
    action: dict[str, Any] = {"kind": "splice", "select": SITE, "module": {"path": str(directory)}}
    if case == "no_cfg":
        write_saelens(directory, t)
        (directory / "cfg.json").unlink()
    elif case == "unknown_arch":
        write_saelens(directory, t, architecture="gated")
    elif case == "index":
        write_saelens(directory, t)
        action["features"] = {"index": [1, 64], "op": "zero"}
    elif case == "missing_tensor":
        write_saelens(directory, t, architecture="jumprelu")
    else:
        write_saelens(directory, {**t, "b_enc": t["b_enc"][:63]})
    before = Snapshot.of(model)
    with pytest.raises(ConfigError) as info:
        surgery.plan(model, {"sae": action})
    expected = message.format(dir=str(directory), cfg=str(directory / "cfg.json"),
                              weights=str(directory / "sae_weights.safetensors"))  # fmt: skip
    assert str(info.value) == expected
    before.assert_same(model)


def test_the_cli_splices_captures_features_and_refuses_bad_widths(tmp_path: Path) -> None:
    from tests.test_cli import cli, only_run_dir

    write_plain(tmp_path / "sae.safetensors", sae_tensors(32, 24))
    (tmp_path / "conf" / "actions").mkdir(parents=True)
    recipe = tmp_path / "conf" / "actions" / "sae.yaml"
    recipe.write_text(
        "sae: {kind: splice, select: layers.0.fc, module: {path: sae.safetensors}, capture: true, error_term: true,"
        " features: {index: [2], op: zero}}\n"
    )
    result = cli("+model=mlp", "+actions=sae", "--config-dir", str(tmp_path / "conf"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    captures = load_file(str(only_run_dir(tmp_path) / "captures.safetensors"))
    assert [k for k in captures if k.startswith("sae/")] == ["sae/layers.0.fc/features"]
    assert captures["sae/layers.0.fc/features"].shape == (4, 24)
    recipe.write_text(
        "sae: {kind: splice, select: layers.0.fc, module: {path: sae.safetensors}, capture: true, features_top: 3,"
        " to: disk}\n"
    )
    streamed = cli("+model=mlp", "+actions=sae", "hydra.run.dir=streamed", "--config-dir", str(tmp_path / "conf"),
                   cwd=tmp_path)  # fmt: skip
    assert streamed.returncode == 0, streamed.stderr
    shard = load_file(str(tmp_path / "streamed" / "captures" / "batch-00000.safetensors"))
    assert sorted(shard) == ["sae/layers.0.fc/features.indices", "sae/layers.0.fc/features.values"]
    assert shard["sae/layers.0.fc/features.values"].shape == (4, 3)
    recipe.write_text("sae: {kind: splice, select: head, read: input, module: {path: sae.safetensors}}\n")
    bad = cli("+model=mlp", "+actions=sae", "--config-dir", str(tmp_path / "conf"), cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0, bad.stderr
    assert (
        "actions.sae.module.path: W_dec in 'sae.safetensors' is [24, 32] (d_out 32), but the output of 'head'"
        in bad.stderr
    )


def test_a_saelens_config_written_before_version_6(lm, tmp_path: Path) -> None:
    """Old cfg.json files: activation_fn_str topk with activation_fn_kwargs.k, a bool normalize_activations."""
    model, ids = lm
    t = sae_tensors(D, S)
    directory = write_saelens(tmp_path / "old", t, architecture="standard", activation_fn_str="topk",
                              activation_fn_kwargs={"k": 6}, normalize_activations=False)  # fmt: skip
    cfg = json.loads((directory / "cfg.json").read_text())
    cfg.pop("metadata")
    (directory / "cfg.json").write_text(json.dumps(cfg))
    got, _ = spliced_logits(model, ids, {"kind": "splice", "select": SITE, "module": {"path": str(directory)}})
    assert torch.equal(
        got, logits_with_hook(model, ids, SITE, lambda m, a, o: hand_decode(t, hand_encode(t, o, "topk", 6)[0]))
    )


@pytest.mark.cuda
def test_a_splice_on_cuda_equals_the_cpu_result(tmp_path: Path) -> None:
    from tests.lm_helpers import tiny_gpt2

    model = tiny_gpt2(20, 1)
    ids = torch.randint(2, 20, (3, 5), generator=torch.Generator().manual_seed(0))
    t = sae_tensors(D, S, threshold=True)
    write_saelens(tmp_path / "sae", t, architecture="jumprelu")
    action = {"kind": "splice", "select": "transformer.h.*", "module": {"path": str(tmp_path / "sae")}, "capture": True,
              "error_term": True, "features": {"index": [3, 9], "op": "mul", "value": 4.0}}  # fmt: skip
    cpu, cpu_caps = spliced_logits(model, ids, action)
    cuda = torch.device("cuda")
    model.to(cuda)
    gpu, gpu_caps = spliced_logits(model, ids.to(cuda), action)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu_caps[SITE].features.cpu(), cpu_caps[SITE].features, rtol=1e-4, atol=1e-4)
