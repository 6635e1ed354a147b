"""The built-in induction LM: +model=induction_lm loads the shipped Llama and tokenizer, the model does
induction on fresh sequences (counted by hand) with a previous-token head and induction heads, and
+experiment=induction_patching finds where the copied word travels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from surgery.app.build import build_model, settings_of
from surgery.app.job import run_job
from surgery.lm.text import load_tokenizer
from surgery.models.induction import WEIGHTS, induction_lm
from tests.test_cli import composed

pytest.importorskip("transformers")


def test_the_shipped_directory_is_small_and_complete() -> None:
    names = {p.name for p in WEIGHTS.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in WEIGHTS.iterdir()) < 1_000_000


def test_the_tokenizer_has_one_token_per_word_and_starts_prompts_with_bos() -> None:
    tok = load_tokenizer(model_path=WEIGHTS)
    assert tok(" w44", add_special_tokens=False)["input_ids"] == [44]
    assert tok("w3 w17 w63")["input_ids"] == [64, 3, 17, 63]  # <bos> is id 64
    assert len(tok) == 67 and tok.pad_token_id == 65


def test_plus_model_induction_lm_does_induction_on_fresh_sequences() -> None:
    cfg = composed("+model=induction_lm")
    model = build_model(cfg.model, settings_of(cfg), torch.device("cpu"))
    gen = torch.Generator().manual_seed(1234)
    first = repeated = total = 0
    for size, before in ((4, 0), (7, 3), (10, 8), (12, 5)):  # 25 rows each: <bos> p s s, all words distinct
        words = torch.stack([torch.randperm(64, generator=gen)[: before + size] for _ in range(25)])
        ids = torch.cat([torch.full((25, 1), 64), words, words[:, before:]], dim=1)
        with torch.no_grad():
            guess = model(input_ids=ids).logits.argmax(-1)
        right = guess[:, :-1] == ids[:, 1:]  # right[:, t]: position t predicted token t + 1
        again = 1 + before + size  # where the second copy starts
        first += int(right[:, again - size : again - 1].sum())  # s[1:] in the first copy: nothing to copy from
        repeated += int(right[:, again : again + size - 1].sum())  # s[1:] in the second copy
        total += 25 * (size - 1)
    assert repeated / total > 0.95
    assert first / total < 0.1


def test_block_0_has_a_previous_token_head_and_block_1_induction_heads() -> None:
    """Counted from the attention weights: head 0.3 looks one token back, block 1's heads at the word after the
    current word's earlier occurrence."""
    gen = torch.Generator().manual_seed(7)
    words = torch.stack([torch.randperm(64, generator=gen)[:14] for _ in range(20)])
    ids = torch.cat([torch.full((20, 1), 64), words, words[:, 4:]], dim=1)  # <bos>, 4 words, 10 words twice
    with torch.no_grad():
        block0, block1 = induction_lm()(input_ids=ids, output_attentions=True).attentions
    query = torch.arange(2, ids.shape[1])
    assert block0[:, 3, query, query - 1].mean() > 0.7
    query = torch.arange(15, ids.shape[1])  # the second copy: its word's earlier occurrence is 10 back
    assert (block1[:, :, query, query - 9].mean((0, 2)) > 0.8).all()


def test_the_default_prompt_continues_the_repeat() -> None:
    cfg = composed("+model=induction_lm")
    tok = load_tokenizer(model_path=WEIGHTS)
    ids = torch.tensor([tok(cfg.model.input.prompt)["input_ids"]])
    with torch.no_grad():
        logits = induction_lm()(input_ids=ids).logits
    assert tok.decode([int(logits[0, -1].argmax())]) == "w25"


def test_the_patching_experiment_finds_the_copied_word(tmp_path: Path) -> None:
    report = run_job(composed("+experiment=induction_patching"), tmp_path)
    assert report["study"]["cells"] == 2 * 13
    mean = load_file(tmp_path / "study.safetensors")["mean/logit_diff"]  # [layer, pos], normalized
    assert mean.shape == (2, 13)
    assert (mean[:, 5] > 0.9).all()  # the first " w25", entering either block: block 1's heads read it there
    others = torch.ones_like(mean, dtype=torch.bool)
    others[:, 5] = False
    assert mean[others].abs().max() < 0.05
    assert (tmp_path / "plots" / "study_logit_diff.png").is_file()


def test_the_head_ablation_study_finds_the_head_the_copy_runs_through(tmp_path) -> None:
    from surgery.lm.text import encode_prompts

    cfg = composed("+experiment=induction_heads")
    report = run_job(cfg, tmp_path)
    means = report["study"]["mean"]["prob"]  # [layer][head]
    assert means[0][3] < 0.2 and report["study"]["baselines"]["unmodified"]["prob"] > 0.9  # the previous-token head
    model = induction_lm()
    tok = load_tokenizer(model_path=model.name_or_path)
    batch = encode_prompts(tok, prompts=list(cfg.input.prompts))
    zero = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda m, a: (a[0].index_fill(-1, torch.arange(48, 64), 0.0),)
    )
    with torch.no_grad():
        z = model(**batch.kwargs()).logits[:, -1].double()
    zero.remove()
    w25 = tok(" w25", add_special_tokens=False)["input_ids"][0]
    assert means[0][3] == pytest.approx(float(torch.softmax(z, -1)[:, w25].mean()), rel=1e-9, abs=1e-12)
