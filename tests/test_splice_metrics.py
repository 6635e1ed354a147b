"""Splice metrics (l0, reconstruction_mse, explained_variance, ce_loss_recovered) against the formulas computed by
hand in plain PyTorch on a tiny GPT-2, over two batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from surgery.errors import ConfigError
from surgery.splice.metrics import splice_metrics
from tests.splice_helpers import hand_decode, hand_encode, sae_tensors, write_plain

SITE = "transformer.h.1"


def hand_ce(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    v = logits.shape[-1]
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, v).double(), ids[:, 1:].reshape(-1), reduction="sum")
    return float(loss), ids[:, 1:].numel()


def test_each_metric_equals_its_formula(tiny_lm: Any, tmp_path: Path) -> None:
    model, clean, corrupt = tiny_lm
    batches = [clean, corrupt]
    t = sae_tensors(32, 64)
    path = write_plain(tmp_path / "sae.safetensors", t)
    actions = {"sae": {"kind": "splice", "select": SITE, "module": {"path": str(path)}}}
    got = splice_metrics(model, actions, batches)

    block, ys, ce = model.transformer.h[1], [], {"clean": [0.0, 0], "splice": [0.0, 0], "zero": [0.0, 0]}
    with torch.no_grad():
        for ids in batches:
            h = block.register_forward_hook(lambda m, a, o: ys.append(o))
            s, n = hand_ce(model(ids).logits, ids)
            ce["clean"][0] += s
            ce["clean"][1] += n
            h.remove()
            h = block.register_forward_hook(lambda m, a, o: hand_decode(t, hand_encode(t, o)[0]))
            s, n = hand_ce(model(ids).logits, ids)
            ce["splice"][0] += s
            ce["splice"][1] += n
            h.remove()
            h = block.register_forward_hook(lambda m, a, o: torch.zeros_like(o))
            s, n = hand_ce(model(ids).logits, ids)
            ce["zero"][0] += s
            ce["zero"][1] += n
            h.remove()
    y = torch.cat([o.reshape(-1, 32) for o in ys])
    f = hand_encode(t, y)[0]
    recon = hand_decode(t, f)
    y, recon = y.double(), recon.double()
    l0 = float((f != 0).sum()) / y.shape[0]
    mse = float(((y - recon) ** 2).mean())
    ev = 1 - float(((y - recon) ** 2).sum()) / float(((y - y.mean(0)) ** 2).sum())
    c, s, z = (ce[k][0] / ce[k][1] for k in ("clean", "splice", "zero"))
    key = f"sae/{SITE}"
    assert got["l0"][key] == pytest.approx(l0, rel=1e-12)
    assert got["reconstruction_mse"][key] == pytest.approx(mse, rel=1e-6)
    assert got["explained_variance"][key] == pytest.approx(ev, rel=1e-6)
    assert (got["ce_clean"], got["ce_splice"], got["ce_zero"]) == pytest.approx((c, s, z), rel=1e-12)
    assert got["ce_loss_recovered"] == pytest.approx(1 - (s - c) / (z - c), rel=1e-12)


def test_metrics_per_site_for_one_sae_per_block_and_refusals(tiny_lm: Any, tmp_path: Path) -> None:
    model, clean, _ = tiny_lm
    for i in range(2):
        write_plain(tmp_path / f"transformer.h.{i}.safetensors", sae_tensors(32, 64, seed=i))
    splice = {"kind": "splice", "select": "transformer.h.*", "module": {"path": str(tmp_path / "{name}.safetensors")}}
    got = splice_metrics(model, {"saes": splice}, [clean], metrics=["l0"])
    assert sorted(got) == ["l0"] and sorted(got["l0"]) == ["saes/transformer.h.0", "saes/transformer.h.1"]
    with pytest.raises(ConfigError, match=r"^actions.saes.error_term: ce_loss_recovered measures the loss"):
        splice_metrics(model, {"saes": {**splice, "error_term": True}}, [clean])
    with pytest.raises(ConfigError, match=r"^metrics: 'l1' is not a splice metric"):
        splice_metrics(model, {"saes": splice}, [clean], metrics=["l1"])


def test_the_cli_reports_splice_metrics_beside_the_logit_metrics(tmp_path: Path) -> None:
    import json

    from tests.splice_helpers import write_saelens
    from tests.test_cli import cli, only_run_dir

    write_saelens(tmp_path / "my_sae", sae_tensors(32, 64))
    (tmp_path / "conf" / "actions").mkdir(parents=True)
    (tmp_path / "conf" / "actions" / "sae.yaml").write_text(
        "sae: {kind: splice, select: transformer.h.1, module: {path: my_sae}}\n"
    )
    result = cli("+model=gpt2_tiny", "+actions=sae", "metrics=[l0,ce_loss_recovered,kl]", "--config-dir",
                 str(tmp_path / "conf"), cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((only_run_dir(tmp_path) / "report.json").read_text())
    found = report["splice_metrics"]
    assert sorted(found) == ["ce_clean", "ce_loss_recovered", "ce_splice", "ce_zero", "l0"]
    assert list(found["l0"]) == ["sae/transformer.h.1"] and 0 < found["l0"]["sae/transformer.h.1"] < 64
    c, s, z = found["ce_clean"], found["ce_splice"], found["ce_zero"]
    assert found["ce_loss_recovered"] == pytest.approx(1 - (s - c) / (z - c), rel=1e-12)
    assert list(report["metrics"]["surgered"]) == ["kl"]
