"""A harvest stores an ``@`` site under its site name, and the shipped induction model can be harvested (issue 39).

The shipped tokenizer names only ``<bos>``; the model's config says ``eos_token_id`` is that token, so the
harvest puts it between documents (and excludes it) as GPT-2 does. Values equal plain hooks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import surgery
from surgery.harvest import harvest_corpus
from surgery.lm.text import load_tokenizer
from surgery.models.induction import WEIGHTS, induction_lm
from tests.harvest_helpers import packed_by_hand


def test_the_shipped_induction_model_is_harvested_under_site_names(tmp_path: Path) -> None:
    model, tok = induction_lm(), load_tokenizer(model_path=WEIGHTS)
    docs = [" ".join(f"w{(7 * i + j) % 64}" for j in range(5 + i % 7)) for i in range(12)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    outcome = harvest_corpus(model, tok, tmp_path / "corpus.jsonl", tmp_path / "acts", ["@resid_pre.1", "@resid_post"],
                             context=8, batch_size=2, progress=False)  # fmt: skip
    sites = outcome.manifest["sites"]
    assert sites == {
        "resid_pre.1": {"shape": [64], "module": "model.layers.1"},
        "resid_post.0": {"shape": [64], "module": "model.layers.0"},
        "resid_post.1": {"shape": [64], "module": "model.layers.1"},
    }
    eos = model.config.eos_token_id
    rows = packed_by_hand(_with_eos(tok, eos), docs, 8)
    assert outcome.manifest["excluded_ids"] == sorted({eos, tok.pad_token_id, tok.bos_token_id})
    found: list[torch.Tensor] = []
    hook = model.model.layers[1].register_forward_pre_hook(lambda m, a, k: found.append(k["hidden_states"].clone())
                                                            if "hidden_states" in k else found.append(a[0].clone()),
                                                            with_kwargs=True)  # fmt: skip
    with torch.no_grad():
        for start in range(0, rows.shape[0], 2):
            model(input_ids=rows[start : start + 2], use_cache=False)
    hook.remove()
    data = surgery.activations.open(tmp_path / "acts", by="row")
    assert torch.equal(torch.stack([data[i]["input_ids"] for i in range(len(data))]), rows)
    assert torch.equal(torch.stack([data[i]["resid_pre.1"] for i in range(len(data))]), torch.cat(found))


def _with_eos(tok, eos: int):
    """The tokenizer as packed_by_hand reads it, with the model's end-of-text id."""

    class WithEos:
        eos_token_id = eos

        def __call__(self, text, **kw):
            return tok(text, **kw)

    return WithEos()
