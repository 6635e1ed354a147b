"""Language models from the command line's job: a saved GPT-2 directory with its tokenizer, text prompts,
generation and clean → corrupted patching, each against the same thing written with transformers by hand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file  # noqa: E402

from surgery.app.job import run_job  # noqa: E402
from surgery.errors import ConfigError  # noqa: E402
from surgery.lm.load import load_pretrained  # noqa: E402
from surgery.lm.text import encode_prompts, load_tokenizer  # noqa: E402
from tests.lm_helpers import forward, hand_generate, tiny_gpt2, trimmed, word_tokenizer  # noqa: E402
from tests.test_cli import composed  # noqa: E402

SENTENCES = ["the cat sat on the mat", "the dog ran in the park", "Paris is in France and Rome is in Italy"]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 and its word-level tokenizer, saved together with save_pretrained."""
    path = tmp_path_factory.mktemp("gpt2-cli")
    tok = word_tokenizer(SENTENCES)
    tiny_gpt2(len(tok), tok.eos_token_id, initializer_range=1.0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def loaded(path: Path) -> tuple[Any, Any]:
    return load_pretrained(path), load_tokenizer(model_path=path)


def test_text_prompts_are_scored_with_perplexity_as_by_hand(lm_dir: Path, tmp_path: Path) -> None:
    zero = "+actions.z={kind: modify_output, select: transformer.h.0.mlp, op: zero}"
    prompts = "+input.prompts=[the cat sat on the, a dog ran]"
    report = run_job(composed("+model=hf", f"model.path={lm_dir}", prompts, zero), tmp_path)
    model, tok = loaded(lm_dir)
    batch = encode_prompts(tok, prompts=["the cat sat on the", "a dog ran"])

    def perplexity(logits: torch.Tensor) -> float:
        targets = batch.input_ids[:, 1:]
        real = (batch.attention_mask[:, 1:] == 1) & (batch.attention_mask[:, :-1] == 1)
        nll = F.cross_entropy(logits[:, :-1].double().transpose(1, 2), targets, reduction="none")
        return math.exp(float(nll[real].sum() / real.sum()))

    before = forward(model, batch).logits
    handle = model.transformer.h[0].mlp.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    after = forward(model, batch).logits
    handle.remove()
    assert report["metrics"]["unmodified"]["perplexity"] == pytest.approx(perplexity(before), rel=1e-9)
    assert report["metrics"]["surgered"]["perplexity"] == pytest.approx(perplexity(after), rel=1e-9)
    assert report["data"]["prompts"] == ["the cat sat on the", "a dog ran"]
    assert torch.equal(load_file(str(tmp_path / "output.safetensors"))["output/logits"], after)


def test_generate_shows_both_continuations_as_generate_with_the_hook_by_hand(lm_dir: Path, tmp_path: Path) -> None:
    zero = "+actions.z={kind: modify_output, select: transformer.h.0.mlp, op: zero}"
    cfg = composed("+model=hf", f"model.path={lm_dir}", zero, "mode=generate", "generate.max_new_tokens=6")
    report = run_job(cfg, tmp_path)
    model, tok = loaded(lm_dir)
    batch = encode_prompts(tok, prompt="The cat sat on the")
    start, eos = batch.input_ids.shape[1], tok.eos_token_id
    plain = trimmed(hand_generate(model, batch, tok, 6), start, eos)[0]
    zeroed = trimmed(hand_generate(model, batch, tok, 6, lambda m, i, o: torch.zeros_like(o)), start, eos)[0]
    row = report["generate"]["prompts"][0]
    assert row["unmodified_tokens"] == plain and row["surgered_tokens"] == zeroed
    assert plain != zeroed and row["surgered"] == tok.decode(zeroed)
    assert "## Generation" in (tmp_path / "report.md").read_text()


def test_patching_from_a_clean_prompt_equals_a_hand_written_patch(lm_dir: Path, tmp_path: Path) -> None:
    corrupt, clean = "the cat sat on the", "the dog ran in the"
    cfg = composed(
        "+model=hf", f"model.path={lm_dir}", "+input=text", f"input.prompt={corrupt}", "+source=text",
        f"source.prompt={clean}", "+actions=patch_resid",
    )  # fmt: skip
    report = run_job(cfg, tmp_path)
    model, tok = loaded(lm_dir)
    seen: dict[str, torch.Tensor] = {}
    block = model.transformer.h[0]
    handle = block.register_forward_hook(lambda m, i, o: seen.setdefault("clean", o.clone()))
    forward(model, encode_prompts(tok, prompt=clean))
    handle.remove()

    def patch(m: Any, i: Any, o: torch.Tensor) -> torch.Tensor:
        o = o.clone()
        o[:, -1] = seen["clean"][:, -1]
        return o

    handle = block.register_forward_hook(patch)
    patched = forward(model, encode_prompts(tok, prompt=corrupt)).logits
    handle.remove()
    assert torch.equal(load_file(str(tmp_path / "output.safetensors"))["output/logits"], patched)
    assert report["data"]["source_prompts"] == [clean]


def test_text_mistakes_are_one_line_naming_the_key(lm_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^source.prompt: .*"):
        run_job(
            composed("+model=hf", f"model.path={lm_dir}", "+input=text", "input.prompt=the cat sat on the",
                     "+source=text", "source.prompt=a dog"),
            tmp_path,
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^mode: generate continues text"):
        run_job(composed("+model=mlp", "mode=generate"), tmp_path)
    with pytest.raises(ConfigError, match=r"^model.path: required"):
        run_job(composed("+model=hf", "mode=plan"), tmp_path)
