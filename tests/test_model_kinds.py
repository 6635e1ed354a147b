"""Models other than a decoder-only LM in float32: T5 (encoder-decoder), ``model.dtype``, a masked LM's metrics,
a vision model's image processor and default input. Each against the same thing written with transformers by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import transformers  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from surgery.app.job import run_job  # noqa: E402
from surgery.errors import ConfigError  # noqa: E402
from surgery.lm.generate import generate_both  # noqa: E402
from surgery.lm.load import load_pretrained  # noqa: E402
from surgery.lm.seq2seq import with_decoder_prompt  # noqa: E402
from surgery.lm.text import encode_prompts, load_tokenizer  # noqa: E402
from tests.lm_helpers import tiny_gpt2, trimmed, word_tokenizer  # noqa: E402
from tests.test_cli import cli, composed  # noqa: E402

SENTENCES = ["the cat sat on the mat", "the dog ran in the park", "Paris is in France and Rome is in Italy"]
T5_STEER = "decoder.final_layer_norm"  # negated: every next token becomes the least likely one


def saved(path: Path, model: Any, tok: Any = None) -> Path:
    model.save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny T5 (pad = decoder start = 0, end-of-text = 1, as T5's own) and a word-level tokenizer."""
    tok = word_tokenizer(SENTENCES)
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, initializer_factor=1.0,
    )  # fmt: skip
    return saved(tmp_path_factory.mktemp("t5"), transformers.T5ForConditionalGeneration(config).eval(), tok)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = word_tokenizer(SENTENCES)
    return saved(tmp_path_factory.mktemp("gpt2"), tiny_gpt2(len(tok), tok.eos_token_id, initializer_range=1.0), tok)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = word_tokenizer(SENTENCES)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return saved(tmp_path_factory.mktemp("bert"), transformers.BertForMaskedLM(config).eval(), tok)


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ViT classifier saved with the image processor it expects (resize to 16×16, normalize by 0.5)."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3,
    )  # fmt: skip
    path = saved(tmp_path_factory.mktemp("vit"), transformers.ViTForImageClassification(config).eval())
    transformers.ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two class folders of PNGs of different sizes, one RGB and one grey."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.RandomState(0)
    (root / "a").mkdir()
    (root / "b").mkdir()
    Image.fromarray((rng.rand(20, 24, 3) * 255).astype("uint8")).save(root / "a" / "one.png")
    Image.fromarray((rng.rand(30, 18) * 255).astype("uint8")).save(root / "b" / "two.png")
    return root


def hf_run(tmp_path: Path, path: Path, *overrides: str) -> dict[str, Any]:
    return run_job(composed("+model=hf", f"model.path={path}", *overrides), tmp_path)


def logits_file(run: Path) -> torch.Tensor:
    return load_file(str(run / "output.safetensors"))["output/logits"]


# ---------------------------------------------------------------- encoder-decoder (T5)


def test_t5_runs_from_the_cli_with_the_decoder_start_token_as_its_decoder_prompt(t5_dir: Path, tmp_path: Path) -> None:
    report = hf_run(tmp_path, t5_dir)
    model, tok = load_pretrained(t5_dir), load_tokenizer(model_path=t5_dir)
    batch = encode_prompts(tok, prompt="The cat sat on the")
    with torch.no_grad():
        want = model(**batch.kwargs(), decoder_input_ids=torch.tensor([[0]])).logits
    assert torch.equal(logits_file(tmp_path), want)
    assert set(report["metrics"]["surgered"]) == {"agreement", "kl"}  # no perplexity for an encoder-decoder model


def test_t5_decoder_prompt_follows_the_start_token(t5_dir: Path, tmp_path: Path) -> None:
    hf_run(tmp_path, t5_dir, "+input.decoder_prompt=the dog", "+input.prompts=[the cat sat, a dog ran in the park]")
    model, tok = load_pretrained(t5_dir), load_tokenizer(model_path=t5_dir)
    batch = encode_prompts(tok, prompts=["the cat sat", "a dog ran in the park"])
    decoder = torch.tensor([[0, *tok("the dog", add_special_tokens=False)["input_ids"]]] * 2)
    with torch.no_grad():
        want = model(**batch.kwargs(), decoder_input_ids=decoder).logits
    assert want.shape[1] == 3 and torch.equal(logits_file(tmp_path), want)


def test_t5_logit_diff_reads_the_decoders_last_position(t5_dir: Path, tmp_path: Path) -> None:
    prompts = "+input.prompts=[the cat sat, a dog ran in the park]"  # left padding on the encoder side only
    metric = "metrics=[{logit_diff: {correct: cat, wrong: dog}}]"
    report = hf_run(tmp_path, t5_dir, prompts, "+input.decoder_prompt=the", metric)
    model, tok = load_pretrained(t5_dir), load_tokenizer(model_path=t5_dir)
    batch = with_decoder_prompt(
        encode_prompts(tok, prompts=["the cat sat", "a dog ran in the park"]), model, tok, "the"
    )
    with torch.no_grad():
        z = model(**batch.kwargs()).logits[:, -1].double()
    cat, dog = (tok(w, add_special_tokens=False)["input_ids"][0] for w in ("cat", "dog"))
    assert report["metrics"]["unmodified"]["logit_diff"] == pytest.approx(float((z[:, cat] - z[:, dog]).mean()))


def t5_hand_generate(model: Any, batch: Any, decoder: torch.Tensor, new: int, zero: bool) -> list[int]:
    """``model.generate`` as a user writes it for T5, the decoder's final norm negated by a hand-written hook or not."""
    module = model.get_submodule(T5_STEER)
    handle = module.register_forward_hook(lambda m, i, o: o * -1.0) if zero else None
    try:
        with torch.no_grad():
            out = model.generate(
                **batch.kwargs(), decoder_input_ids=decoder, max_new_tokens=new, do_sample=False, use_cache=True
            )
    finally:
        if handle is not None:
            handle.remove()
    return trimmed(out, decoder.shape[1], 1)[0]


@pytest.mark.parametrize("decoder_prompt", [None, "the dog"])
def test_t5_generate_compares_the_new_tokens_and_reports_a_real_change(
    t5_dir: Path, tmp_path: Path, decoder_prompt: str | None
) -> None:
    zero = f"+actions.z={{kind: modify_output, select: {T5_STEER}, op: mul, value: -1}}"
    extra = [] if decoder_prompt is None else [f"+input.decoder_prompt={decoder_prompt}"]
    report = hf_run(tmp_path, t5_dir, zero, "mode=generate", "generate.max_new_tokens=8", *extra)
    model, tok = load_pretrained(t5_dir), load_tokenizer(model_path=t5_dir)
    batch = encode_prompts(tok, prompt="The cat sat on the")
    decoder = torch.tensor(
        [[0, *tok(decoder_prompt, add_special_tokens=False)["input_ids"]]] if decoder_prompt else [[0]]
    )
    plain, zeroed = (t5_hand_generate(model, batch, decoder, 8, z) for z in (False, True))
    row = report["generate"]["prompts"][0]
    assert row["unmodified_tokens"] == plain and row["surgered_tokens"] == zeroed
    assert plain != zeroed and row["first_difference"] is not None  # the bug: both cut to [] and called the same
    assert len(plain) == 8 or plain[-1] == 1  # every new token, none of the decoder prompt


def test_t5_generate_both_in_python_starts_from_the_decoder_start_token(t5_dir: Path) -> None:
    model, tok = load_pretrained(t5_dir), load_tokenizer(model_path=t5_dir)
    batch = encode_prompts(tok, prompt="the cat sat on the mat")
    zero = {"z": {"kind": "modify_output", "select": T5_STEER, "op": "mul", "value": -1.0}}
    out = generate_both(model, zero, batch, max_new_tokens=5, tokenizer=tok)
    assert list(out.unmodified[0]) == t5_hand_generate(model, batch, torch.tensor([[0]]), 5, False)
    assert list(out.surgered[0]) == t5_hand_generate(model, batch, torch.tensor([[0]]), 5, True)
    same = generate_both(model, zero, with_decoder_prompt(batch, model, tok, "the"), max_new_tokens=5, tokenizer=tok)
    the = tok("the", add_special_tokens=False)["input_ids"]
    assert list(same.unmodified[0]) == t5_hand_generate(model, batch, torch.tensor([[0, *the]]), 5, False)


def test_decoder_only_generation_still_starts_after_each_left_padded_prompt(gpt2_dir: Path, tmp_path: Path) -> None:
    prompts = ["the cat sat on the", "a dog"]
    report = hf_run(
        tmp_path, gpt2_dir, "mode=generate", "generate.max_new_tokens=5", f"+input.prompts=[{', '.join(prompts)}]"
    )
    model, tok = load_pretrained(gpt2_dir), load_tokenizer(model_path=gpt2_dir)
    batch = encode_prompts(tok, prompts=prompts)
    with torch.no_grad():
        out = model.generate(
            **batch.kwargs(), max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=tok.eos_token_id
        )
    want = trimmed(out, batch.input_ids.shape[1], tok.eos_token_id)
    assert [row["unmodified_tokens"] for row in report["generate"]["prompts"]] == want


def test_a_decoder_prompt_on_a_decoder_only_model_is_refused(gpt2_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^input.decoder_prompt: only encoder-decoder models .* put all the text"):
        hf_run(tmp_path, gpt2_dir, "+input.decoder_prompt=the")


# ---------------------------------------------------------------- model.dtype


def test_model_dtype_is_honoured_when_the_run_names_none(bert_dir: Path, tmp_path: Path) -> None:
    report = hf_run(tmp_path, bert_dir, "model.dtype=bfloat16")
    model, tok = load_pretrained(bert_dir, dtype="bfloat16"), load_tokenizer(model_path=bert_dir)
    with torch.no_grad():
        want = model(**encode_prompts(tok, prompt="The cat sat on the").kwargs()).logits
    assert want.dtype == torch.bfloat16 and torch.equal(logits_file(tmp_path), want)
    assert report["output"]["dtype"] == "bfloat16"


def test_the_run_dtype_still_casts_a_model_that_names_none(bert_dir: Path, tmp_path: Path) -> None:
    assert hf_run(tmp_path, bert_dir, "dtype=float64")["output"]["dtype"] == "float64"
    assert (
        hf_run(tmp_path / "same", bert_dir, "dtype=bfloat16", "model.dtype=bfloat16")["output"]["dtype"] == "bfloat16"
    )


def test_a_run_dtype_that_contradicts_model_dtype_exits_2_in_one_line(bert_dir: Path, tmp_path: Path) -> None:
    result = cli("+model=hf", f"model.path={bert_dir}", "model.dtype=bfloat16", "dtype=float32", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "error: dtype: the run's dtype=float32 contradicts model.dtype=bfloat16; drop dtype (it follows model.dtype),"
        " or set both to the same, e.g. dtype=bfloat16 model.dtype=bfloat16"
    ]
    assert not list(tmp_path.glob("outputs/*/*/report.json"))


# ---------------------------------------------------------------- masked LMs: no next-token metrics


def test_a_masked_lm_refuses_perplexity_and_names_what_works(bert_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^metrics: perplexity .* BertForMaskedLM is a masked language model.*; use agreement, kl"
    ):
        hf_run(tmp_path, bert_dir, "metrics=[perplexity, kl]")
    report = hf_run(tmp_path, bert_dir)  # the default leaves perplexity out
    assert set(report["metrics"]["surgered"]) == {"agreement", "kl"}


def test_perplexity_is_refused_on_t5_and_in_evaluate_but_kept_for_a_causal_lm(
    t5_dir: Path, bert_dir: Path, gpt2_dir: Path, tmp_path: Path
) -> None:
    import surgery

    with pytest.raises(ConfigError, match=r"^metrics: perplexity .* T5ForConditionalGeneration is an encoder-decoder"):
        hf_run(tmp_path, t5_dir, "metrics=[perplexity]")
    model, tok = load_pretrained(bert_dir), load_tokenizer(model_path=bert_dir)
    batch = encode_prompts(tok, prompt="the cat sat")
    with pytest.raises(ConfigError, match=r"^metrics: perplexity .* masked language model"):
        surgery.evaluate(model, [(batch.input_ids, batch.labels)], metrics=["perplexity"])
    assert "perplexity" in hf_run(tmp_path, gpt2_dir)["metrics"]["surgered"]


def test_a_study_refuses_the_next_token_loss_on_a_masked_lm(bert_dir: Path, tmp_path: Path) -> None:
    study = "+study={grid: {layer: [0, 1]}, metrics: [loss]}"
    zero = "+actions.z={kind: modify_output, select: 'bert.encoder.layer.{layer}.output', op: zero}"
    with pytest.raises(ConfigError, match=r"^study.metrics: loss .* masked language model.*; use kl, logit_diff"):
        hf_run(tmp_path, bert_dir, study, zero)


# ---------------------------------------------------------------- vision: the saved image processor


def by_hand(vit_dir: Path, *paths: Path) -> torch.Tensor:
    """The logits a user gets: AutoImageProcessor from the directory on each PIL image, then the model."""
    processor = transformers.AutoImageProcessor.from_pretrained(str(vit_dir), local_files_only=True)
    model = load_pretrained(vit_dir)
    pixels = torch.cat(
        [processor(images=Image.open(p).convert("RGB"), return_tensors="pt")["pixel_values"] for p in paths]
    )
    with torch.no_grad():
        return model(pixels).logits


def test_a_png_goes_through_the_models_image_processor(vit_dir: Path, images: Path, tmp_path: Path) -> None:
    png = images / "a" / "one.png"
    report = hf_run(tmp_path, vit_dir, "+input=file", f"input.path={png}")
    assert torch.equal(logits_file(tmp_path), by_hand(vit_dir, png))
    assert report["input"][0]["shape"] == [1, 3, 16, 16] and report["input"][0]["min"] < 0  # normalized, not [0, 1]
    assert "ViTImageProcessor" in report["data"]["source"]


def test_an_image_folder_goes_through_the_models_image_processor(vit_dir: Path, images: Path, tmp_path: Path) -> None:
    report = hf_run(tmp_path, vit_dir, "+input=dataset", f"input.path={images}")
    assert torch.equal(logits_file(tmp_path), by_hand(vit_dir, images / "a" / "one.png", images / "b" / "two.png"))
    assert report["metrics"]["surgered"]["accuracy"] is not None  # labels from the class folders


def test_a_datasets_image_column_goes_through_the_models_image_processor(
    vit_dir: Path, images: Path, tmp_path: Path
) -> None:
    pytest.importorskip("datasets")
    from tests.test_files_trust import image_cells

    pngs = [images / "a" / "one.png", images / "b" / "two.png"]
    data = image_cells(tmp_path / "data", [{"bytes": p.read_bytes(), "path": None} for p in pngs])
    hf_run(tmp_path / "run", vit_dir, "+input=dataset", f"input.path={data}", "input.split=all")
    assert torch.equal(logits_file(tmp_path / "run"), by_hand(vit_dir, *pngs))


def test_a_vision_model_defaults_to_an_image_input_not_text(vit_dir: Path, tmp_path: Path) -> None:
    report = hf_run(tmp_path, vit_dir)
    assert report["input"][0]["shape"] == [1, 3, 16, 16] and report["input"][0]["dtype"] == "float32"
    assert report["output"]["shape"] == [1, 3]


def test_text_on_a_vision_model_says_the_directory_has_no_tokenizer_in_one_whole_line(
    vit_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as refused:
        hf_run(tmp_path, vit_dir, "+input=text", "input.prompt=the cat")
    assert str(refused.value) == (
        f"input.tokenizer (default: model.path): {str(vit_dir)!r} holds no tokenizer (tokenizer.json,"
        " tokenizer_config.json, ...); give input.tokenizer=DIR_OR_TOKENIZER_JSON, or an image input for this"
        " vision model (+input=file input.path=IMAGE.png)"
    )


# ---------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_generation_on_cuda_in_half_precision_equals_generate_by_hand(
    gpt2_dir: Path, t5_dir: Path, tmp_path: Path, dtype: str
) -> None:
    zero = "+actions.z={kind: modify_output, select: transformer.h.0.mlp, op: zero}"
    report = hf_run(
        tmp_path, gpt2_dir, zero, "mode=generate", "generate.max_new_tokens=6", "device=cuda", f"model.dtype={dtype}"
    )
    model = load_pretrained(gpt2_dir, dtype=dtype).to(torch.device("cuda"))
    tok = load_tokenizer(model_path=gpt2_dir)
    batch = encode_prompts(tok, prompt="The cat sat on the").to("cuda")

    def generate(zeroed: bool) -> list[int]:
        hook = (lambda m, i, o: torch.zeros_like(o)) if zeroed else None
        handle = model.transformer.h[0].mlp.register_forward_hook(hook) if hook else None
        try:
            with torch.no_grad():
                out = model.generate(
                    **batch.kwargs(), max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=tok.eos_token_id
                )
        finally:
            if handle is not None:
                handle.remove()
        return trimmed(out.cpu(), batch.input_ids.shape[1], tok.eos_token_id)[0]

    row = report["generate"]["prompts"][0]
    assert row["unmodified_tokens"] == generate(False) and row["surgered_tokens"] == generate(True)
    t5 = hf_run(
        tmp_path / "t5", t5_dir, "mode=generate", "generate.max_new_tokens=6", "device=cuda", f"model.dtype={dtype}"
    )
    model = load_pretrained(t5_dir, dtype=dtype).to(torch.device("cuda"))
    t5_batch = encode_prompts(load_tokenizer(model_path=t5_dir), prompt="The cat sat on the").to("cuda")
    with torch.no_grad():
        out = model.generate(
            **t5_batch.kwargs(), decoder_input_ids=torch.tensor([[0]], device="cuda"), max_new_tokens=6,
            do_sample=False, use_cache=True,
        )  # fmt: skip
    assert t5["generate"]["prompts"][0]["unmodified_tokens"] == trimmed(out.cpu(), 1, 1)[0]
