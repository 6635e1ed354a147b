"""The built-in induction LM: +model=induction_lm loads the shipped GPT-2 and tokenizer, the model does
induction on fresh sequences (counted by hand), and +experiment=induction_patching finds where the
copied word travels."""

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
    for size in (4, 7, 10, 12):  # 25 rows per length: <bos> s s, s distinct words
        words = torch.stack([torch.randperm(64, generator=gen)[:size] for _ in range(25)])
        ids = torch.cat([torch.full((25, 1), 64), words, words], dim=1)
        with torch.no_grad():
            guess = model(input_ids=ids).logits.argmax(-1)
        right = guess[:, :-1] == ids[:, 1:]  # right[:, t]: position t predicted token t + 1
        first += int(right[:, 1:size].sum())  # s[1:] in the first copy: nothing to copy from
        repeated += int(right[:, size + 1 : 2 * size].sum())  # s[1:] in the second copy
        total += 25 * (size - 1)
    assert repeated / total > 0.9
    assert first / total < 0.1


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
    assert mean[0, 5] > 0.9 and mean[1, 12] > 0.9  # the first " w25" entering block 0; the last position after it
    others = torch.ones_like(mean, dtype=torch.bool)
    others[0, 5] = others[1, 12] = False
    assert mean[others].abs().max() < 0.05
    assert (tmp_path / "plots" / "study_logit_diff.png").is_file()


def test_the_head_ablation_study_finds_the_head_the_copy_runs_through(tmp_path) -> None:
    from surgery.lm.text import encode_prompts

    cfg = composed("+experiment=induction_heads")
    report = run_job(cfg, tmp_path)
    means = report["study"]["mean"]["prob"]  # [layer][head]
    assert means[0][0] < 0.1 and report["study"]["baselines"]["unmodified"]["prob"] > 0.9
    model = induction_lm()
    tok = load_tokenizer(model_path=model.name_or_path)
    batch = encode_prompts(tok, prompts=list(cfg.input.prompts))
    zero = model.transformer.h[0].attn.c_proj.register_forward_pre_hook(
        lambda m, a: (a[0].index_fill(-1, torch.arange(0, 16), 0.0),)
    )
    with torch.no_grad():
        z = model(**batch.kwargs()).logits[:, -1].double()
    zero.remove()
    w25 = tok(" w25", add_special_tokens=False)["input_ids"][0]
    assert means[0][0] == pytest.approx(float(torch.softmax(z, -1)[:, w25].mean()), rel=1e-9, abs=1e-12)
