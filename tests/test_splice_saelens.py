"""Splices against SAELens itself: an SAE saved by SAELens's ``save_model`` and spliced by surgery gives exactly what
SAELens's own forward gives; a splice saved with ``save_added(DIR, format="saelens")`` (trained with ``train: true`` or
not) is read by ``SAE.load_from_disk`` to the same encode and decode. scripts/setup installs sae-lens beside torch
2.13 CPU (``pip install 'surgery[compare]'``), so these run in the suite."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import sae_lens
import torch
from torch import nn

import surgery
from surgery.errors import ConfigError

D, S = 16, 48


def saved(kind: str, directory: Path, **cfg: Any) -> Any:
    """A SAELens SAE of ``kind`` with random weights (a random threshold for JumpReLU), saved to ``directory``."""
    from sae_lens.saes.transcoder import Transcoder, TranscoderConfig

    classes = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
        "transcoder": (Transcoder, TranscoderConfig),
    }
    cls, config = classes[kind]
    torch.manual_seed(0)
    sae = cls(config(d_in=D, d_sae=S, **cfg))
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name != "threshold" else 0.1))
        if kind == "jumprelu":
            sae.threshold.abs_()
    sae.save_model(directory)
    return sae.eval()


CASES = [
    ("standard", {}),
    ("standard", {"apply_b_dec_to_input": False}),
    ("standard", {"normalize_activations": "constant_norm_rescale"}),
    ("standard", {"normalize_activations": "layer_norm"}),
    ("jumprelu", {}),
    ("topk", {"k": 6}),
    ("topk", {"k": 6, "rescale_acts_by_decoder_norm": True}),
    ("transcoder", {"d_out": D, "apply_b_dec_to_input": False}),
]


@pytest.mark.parametrize(("kind", "cfg"), CASES, ids=[f"{k}-{'-'.join(c) or 'plain'}" for k, c in CASES])
def test_a_splice_equals_saelens_forward(tmp_path: Path, kind: str, cfg: dict) -> None:
    sae = saved(kind, tmp_path / "sae", **cfg)
    model = nn.Sequential(nn.Linear(D, D))
    x = torch.randn(3, 5, D)
    action = {"kind": "splice", "select": "0", "module": {"path": str(tmp_path / "sae")}, "capture": True}
    if kind == "transcoder":
        action["read"] = "input"
    with torch.no_grad(), surgery.apply(model, {"sae": action}) as s:
        got = model(x)
        features = s.captures["sae"]["0"].features
    with torch.no_grad():
        read = x if kind == "transcoder" else model(x)
        assert torch.equal(got, sae(read))
        assert torch.equal(features, sae.encode(read))


def test_error_term_and_a_feature_edit_equal_saelens_use_error_term(tmp_path: Path) -> None:
    sae = saved("jumprelu", tmp_path / "sae")
    with pytest.warns(DeprecationWarning):  # SAELens 6 prefers HookedSAETransformer.add_sae(..., use_error_term=True)
        sae.use_error_term = True
    sae.hook_sae_acts_post.register_forward_hook(lambda m, a, o: o.index_fill(-1, torch.tensor([1, 7]), 0.0))
    model = nn.Sequential(nn.Linear(D, D))
    x = torch.randn(3, 5, D)
    action = {"kind": "splice", "select": "0", "module": {"path": str(tmp_path / "sae")}, "error_term": True,
              "features": {"index": [1, 7], "op": "zero"}}  # fmt: skip
    with torch.no_grad(), surgery.apply(model, {"sae": action}):
        got = model(x)
    with torch.no_grad():
        assert torch.equal(got, sae(model(x)))


@pytest.mark.parametrize(("kind", "cfg"), CASES, ids=[f"{k}-{'-'.join(c) or 'plain'}" for k, c in CASES])
def test_a_splice_saved_as_saelens_loads_in_saelens_to_the_same_sae(tmp_path: Path, kind: str, cfg: dict) -> None:
    sae = saved(kind, tmp_path / "sae", **cfg)
    model = nn.Sequential(nn.Linear(D, D))
    action = {"kind": "splice", "select": "0", "module": {"path": str(tmp_path / "sae")}}
    if kind == "transcoder":
        action["read"] = "input"
    with surgery.apply(model, {"sae": action}) as s:
        s.save_added(tmp_path / "again", format="saelens")
    back = sae_lens.SAE.load_from_disk(tmp_path / "again")
    assert type(back) is type(sae) and back.cfg.to_dict() | {"metadata": {}} == sae.cfg.to_dict() | {"metadata": {}}
    x = torch.randn(3, 5, D)
    with torch.no_grad():
        assert torch.equal(back.encode(x), sae.encode(x)) and torch.equal(back(x), sae(x))


@pytest.mark.parametrize(("kind", "cfg"), [("standard", {}), ("topk", {"k": 6})], ids=["standard", "topk"])
def test_a_trained_splice_equals_the_saelens_sae_trained_the_same_way_and_saves_as_it(
    tmp_path: Path, kind: str, cfg: dict
) -> None:
    """``train: true``: SGD on the splice's parameters equals SGD on SAELens's SAE hooked in by hand, bit for bit."""
    sae = saved(kind, tmp_path / "sae", **cfg).train()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, 3))
    ref = copy.deepcopy(model).requires_grad_(False)
    model.requires_grad_(False)
    ref[0].register_forward_hook(lambda m, args, out: sae(out))
    xs = torch.randn(4, 5, D, generator=torch.Generator().manual_seed(2))
    action = {"kind": "splice", "select": "0", "module": {"path": str(tmp_path / "sae")}, "train": True}
    with surgery.apply(model, {"sae": action}) as s:
        ours = [p for p in model.parameters() if p.requires_grad]
        assert sorted(s.added_state_dict()) == ["0.W_dec", "0.W_enc", "0.b_dec", "0.b_enc"] and len(ours) == 4
        for params, net in ((ours, model), (list(sae.parameters()), ref)):
            opt = torch.optim.SGD(params, lr=0.1)
            for x in xs:
                net(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        for name, tensor in s.added_state_dict().items():
            assert torch.equal(tensor, getattr(sae, name.split(".")[1])), name
        assert not torch.equal(s.added_state_dict()["0.W_enc"], saved(kind, tmp_path / "first", **cfg).W_enc)
        s.save_added(tmp_path / "trained", format="saelens")
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # removed
    back = sae_lens.SAE.load_from_disk(tmp_path / "trained")
    x = torch.randn(3, D)
    with torch.no_grad():
        assert torch.equal(back.encode(x), sae.encode(x)) and torch.equal(back.decode(back.encode(x)), sae(x))


def test_several_splices_save_one_directory_per_module_and_read_back(tmp_path: Path) -> None:
    saved("standard", tmp_path / "sae")
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))
    x = torch.randn(2, D)
    action = {"kind": "splice", "select": ["0", "1"], "module": {"path": str(tmp_path / "sae")}}
    with torch.no_grad(), surgery.apply(model, {"sae": action}) as s:
        expected = model(x)
        s.save_added(tmp_path / "out", format="saelens")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0", "1"]
    back = {**action, "module": {"path": str(tmp_path / "out" / "{name}")}}
    with torch.no_grad(), surgery.apply(model, {"sae": back}):
        assert torch.equal(model(x), expected)


def test_format_saelens_without_a_splice_is_refused(tmp_path: Path) -> None:
    with surgery.apply(nn.Linear(2, 2), {"c": {"kind": "capture"}}) as s:
        with pytest.raises(ConfigError, match=r"^save_added.format: saelens writes kind: splice actions"):
            s.save_added(tmp_path / "x", format="saelens")
