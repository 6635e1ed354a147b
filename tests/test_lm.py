"""Language models from a local directory: loading, prompts, capture, ablation, generation and LM metrics.

Every check compares with the same thing written by hand with transformers and plain PyTorch hooks.
One tiny GPT-2 and a word-level tokenizer are built and saved once per session; nothing downloads.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import surgery  # noqa: E402
from surgery.data.metrics import Scores  # noqa: E402
from surgery.errors import ActionError, ConfigError  # noqa: E402
from surgery.files.checkpoints import load_checkpoint  # noqa: E402
from surgery.lm.generate import first_difference, generate_both  # noqa: E402
from surgery.lm.load import load_pretrained  # noqa: E402
from surgery.lm.metrics import last_positions, logit_diff, text_metrics  # noqa: E402
from surgery.lm.text import check_vocabulary, encode_prompts, load_tokenizer, require_equal_lengths  # noqa: E402
from tests.lm_helpers import SavedLM, forward, hand_generate, tiny_gpt2, trimmed, word_tokenizer  # noqa: E402

SENTENCES = [
    "the cat sat on the mat",
    "the dog ran in the park",
    "a bird sang in the tree",
    "Paris is in France and Rome is in Italy",
]
PROMPTS = ["the cat sat on the", "a dog ran"]  # 5 and 3 tokens: left padding is exercised
ZERO_MLP = {"z": {"kind": "modify_output", "select": "transformer.h.0.mlp", "op": "zero"}}


@pytest.fixture(scope="session")
def saved_lm(tmp_path_factory: pytest.TempPathFactory) -> SavedLM:
    """A tiny GPT-2 and its tokenizer saved together with save_pretrained, built once."""
    path = tmp_path_factory.mktemp("tiny-gpt2")
    tok = word_tokenizer(SENTENCES)
    model = tiny_gpt2(len(tok), tok.eos_token_id, initializer_range=1.0)  # large weights: varied, not repeated tokens
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return SavedLM(path, model, len(tok))


@pytest.fixture
def lm(saved_lm: SavedLM) -> tuple[nn.Module, Any]:
    return load_pretrained(saved_lm.path), load_tokenizer(model_path=saved_lm.path)


def test_loaded_model_equals_the_saved_one_with_its_tie(saved_lm: SavedLM, lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    assert type(model).__name__ == "GPT2LMHeadModel" and not model.training
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.config._attn_implementation == "eager"
    batch = encode_prompts(tok, prompts=PROMPTS)
    assert torch.equal(forward(model, batch).logits, forward(saved_lm.model, batch).logits)
    for name, tensor in saved_lm.model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_dtype_and_task_choose_how_it_loads(saved_lm: SavedLM) -> None:
    assert load_pretrained(saved_lm.path, dtype="float64").transformer.wte.weight.dtype == torch.float64
    base = load_pretrained(saved_lm.path, task="base")
    assert type(base).__name__ == "GPT2Model"


def test_build_model_loads_the_hf_config(saved_lm: SavedLM) -> None:
    """conf/model/hf.yaml through the CLI's builder: its keys reach load_pretrained, input is left aside."""
    from hydra import compose, initialize_config_dir

    from surgery.app.build import build_model, settings_of
    from surgery.core.paths import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["+model=hf", f"model.path={saved_lm.path}", "+input=text"])
    assert cfg.model.input.kind == "text" and cfg.input.kind == "text"
    model = build_model(cfg.model, settings_of(cfg), torch.device("cpu"))
    assert type(model).__name__ == "GPT2LMHeadModel"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "nowhere", "model.path: '{d}/nowhere' does not exist"),
        (lambda d: d / "model.safetensors", "model.path: '{d}/model.safetensors' is a file"),
        (lambda d: d / "empty", "model.path: '{d}/empty' has no config.json (it holds nothing)"),
        (lambda d: "???", "model.path: a local directory written by save_pretrained is required"),
    ],
    ids=["missing", "file", "no_config", "unset"],
)
def test_bad_model_paths_are_refused(
    saved_lm: SavedLM, tmp_path: Path, make: Callable[[Path], Any], message: str
) -> None:
    shutil.copy(saved_lm.path / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as info:
        load_pretrained(make(tmp_path))
    assert str(info.value).startswith(message.format(d=tmp_path))


def test_weights_that_do_not_fit_the_config_are_refused(saved_lm: SavedLM, tmp_path: Path) -> None:
    shutil.copytree(saved_lm.path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    with pytest.raises(ConfigError, match=r"^model\.path: the weights in .* do not fit .*missing: transformer\.h\.2\."):
        load_pretrained(tmp_path / "m")


def test_a_save_pretrained_directory_loads_as_a_checkpoint(saved_lm: SavedLM) -> None:
    """model.safetensors lacks lm_head.weight (tied to the embedding): loading it is fine, and exact."""
    batch = encode_prompts(load_tokenizer(model_path=saved_lm.path), prompts=PROMPTS)
    for path in (saved_lm.path, saved_lm.path / "model.safetensors"):
        model = tiny_gpt2(saved_lm.vocab, 1, seed=7)
        load_checkpoint(model, path)
        assert model.lm_head.weight is model.transformer.wte.weight
        assert torch.equal(forward(model, batch).logits, forward(saved_lm.model, batch).logits)


def test_a_really_missing_key_is_still_refused(saved_lm: SavedLM, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(saved_lm.path / "model.safetensors"))
    del state["transformer.h.1.mlp.c_fc.bias"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing keys: transformer\.h\.1\.mlp\.c_fc\.bias\)$"):
        load_checkpoint(tiny_gpt2(saved_lm.vocab, 1), tmp_path)


def test_tokenizer_from_a_directory_a_json_file_or_the_model_dir(saved_lm: SavedLM, tmp_path: Path) -> None:
    word_tokenizer(SENTENCES).backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    expected = encode_prompts(word_tokenizer(SENTENCES), prompts=PROMPTS)
    for tok in (
        load_tokenizer(saved_lm.path),
        load_tokenizer(tmp_path / "tokenizer.json"),
        load_tokenizer(None, model_path=saved_lm.path),
    ):
        got = encode_prompts(tok, prompts=PROMPTS)  # a bare tokenizer.json has no end-of-text: pads with id 0
        assert torch.equal(got.labels, expected.labels) and torch.equal(got.attention_mask, expected.attention_mask)


def test_prompts_are_padded_on_the_left_and_masked(lm: tuple[nn.Module, Any]) -> None:
    _, tok = lm
    batch = encode_prompts(tok, prompts=PROMPTS)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    eos = tok.eos_token_id
    assert batch.input_ids.tolist() == [ids[0], [eos, eos] + ids[1]]
    assert batch.attention_mask.tolist() == [[1] * 5, [0, 0, 1, 1, 1]]
    assert batch.labels.tolist() == [ids[0], [-100, -100] + ids[1]]
    assert batch.lengths == (5, 3)


@pytest.mark.parametrize(
    ("prompt", "prompts", "message"),
    [
        ("", None, "input.prompt: an empty prompt"),
        ("   ", None, "input.prompt: an empty prompt"),
        (None, None, "input.prompt: a text prompt is required"),
        (None, [], "input.prompts: a non-empty list of texts"),
        (None, ["the cat", ""], "input.prompts[1]: an empty prompt"),
        ("the cat", ["a dog"], "input.prompts: give input.prompt or input.prompts, not both"),
    ],
)
def test_empty_or_missing_prompts_are_refused(
    lm: tuple[nn.Module, Any], prompt: Any, prompts: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        encode_prompts(lm[1], prompt=prompt, prompts=prompts)
    assert str(info.value).startswith(message)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(saved_lm: SavedLM, lm: tuple[nn.Module, Any]) -> None:
    _, tok = lm
    check_vocabulary(tok, lm[0], encode_prompts(tok, prompts=PROMPTS))  # fits
    small = tiny_gpt2(saved_lm.vocab - 4, 1)
    with pytest.raises(
        ConfigError, match=rf"^input\.tokenizer: the tokenizer has {saved_lm.vocab} tokens but the model"
    ):
        check_vocabulary(tok, small)


def test_source_prompts_need_equal_token_lengths(lm: tuple[nn.Module, Any]) -> None:
    _, tok = lm
    corrupt = encode_prompts(tok, prompt="the dog sat on the")
    require_equal_lengths(corrupt, encode_prompts(tok, prompt="the cat sat on the"))
    with pytest.raises(ConfigError, match=r"^source\.prompt: 'the cat sat' is 3 tokens and the input prompt"):
        require_equal_lengths(corrupt, encode_prompts(tok, prompt="the cat sat"))
    with pytest.raises(ConfigError, match=r"^source\.prompt: 2 source prompt\(s\) for 1 input prompt"):
        require_equal_lengths(corrupt, encode_prompts(tok, prompts=["the cat", "a dog"]))


def test_capture_on_a_block_equals_output_hidden_states(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompts=PROMPTS)
    hidden = forward(model, batch, output_hidden_states=True).hidden_states
    with surgery.apply(model, {"c": {"kind": "capture", "select": "transformer.h.0"}}) as s:
        forward(model, batch)
        assert torch.equal(s.captures["c"]["transformer.h.0"].output, hidden[1])


def test_zero_ablation_equals_a_hand_written_hook(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompts=PROMPTS)
    handle = model.transformer.h[0].mlp.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    expected = forward(model, batch).logits
    handle.remove()
    with surgery.apply(model, ZERO_MLP):
        got = forward(model, batch).logits
    assert torch.equal(got, expected)
    assert not torch.equal(got, forward(model, batch).logits)


def test_generation_under_a_surgery_equals_generate_with_the_hook_by_hand(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompts=PROMPTS)
    out = generate_both(model, ZERO_MLP, batch, max_new_tokens=6, tokenizer=tok)
    eos, start = tok.eos_token_id, batch.input_ids.shape[1]
    after = trimmed(hand_generate(model, batch, tok, 6, lambda m, i, o: torch.zeros_like(o)), start, eos)
    before = trimmed(hand_generate(model, batch, tok, 6), start, eos)
    assert [list(r) for r in out.surgered] == after and [list(r) for r in out.unmodified] == before
    assert out.surgered_text == tuple(tok.decode(r, skip_special_tokens=True) for r in after)
    assert out.unmodified_text == tuple(tok.decode(r, skip_special_tokens=True) for r in before)
    assert out.first_difference == tuple(first_difference(a, b) for a, b in zip(after, before))
    assert out.first_difference == (1, 0) and len(set(after[0])) > 2  # the ablation changes varied continuations
    assert out.to_dict()["prompts"][0]["prompt"] == PROMPTS[0]
    assert surgery.core.restore.hooks_on(model) == 0


def test_hooks_fire_on_the_prompt_pass_and_every_new_token(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompts=PROMPTS)
    out = generate_both(model, {"c": {"kind": "capture", "select": "transformer.h.0"}}, batch, max_new_tokens=4)
    calls = out.captures["c"]["transformer.h.0"].calls
    assert len(calls) == max(len(r) for r in out.surgered)  # one forward call per generated token
    assert list(calls[0].output.shape) == [2, 5, 32]  # call 0: the prompt pass
    assert all(list(c.output.shape) == [2, 1, 32] for c in calls[1:])  # then one token each (key/value cache)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_a_weight_change_generates_the_reference_from_a_copy(saved_lm: SavedLM, lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompt="the cat sat on the")
    zero = {"w": {"kind": "init", "select": "transformer.h.0.mlp.c_proj", "param": "weight", "method": "zeros"}}
    out = generate_both(model, zero, batch, max_new_tokens=5)
    start, eos = batch.input_ids.shape[1], tok.eos_token_id
    assert [list(r) for r in out.unmodified] == trimmed(hand_generate(saved_lm.model, batch, tok, 5), start, eos)
    edited = load_pretrained(saved_lm.path)
    with torch.no_grad():
        edited.transformer.h[0].mlp.c_proj.weight.zero_()
    assert [list(r) for r in out.surgered] == trimmed(hand_generate(edited, batch, tok, 5), start, eos)
    assert out.surgered != out.unmodified
    assert torch.equal(model.transformer.h[0].mlp.c_proj.weight, saved_lm.model.transformer.h[0].mlp.c_proj.weight)
    with surgery.apply(model, zero) as applied, pytest.raises(ActionError, match="change weights or modules"):
        generate_both(model, applied, batch, max_new_tokens=2)


def test_an_applied_hook_surgery_is_paused_for_the_unmodified_run(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompts=PROMPTS)
    with surgery.apply(model, ZERO_MLP) as applied:
        out = generate_both(model, applied, batch, max_new_tokens=4)
        assert applied.active
    assert out == generate_both(model, ZERO_MLP, batch, max_new_tokens=4)


def test_a_model_that_cannot_generate_is_refused(saved_lm: SavedLM, lm: tuple[nn.Module, Any]) -> None:
    base = load_pretrained(saved_lm.path, task="base")
    with pytest.raises(ConfigError, match=r"^mode: generate needs a model that generates text .* GPT2Model cannot"):
        generate_both(base, ZERO_MLP, encode_prompts(lm[1], prompt="the cat"), max_new_tokens=2)


def test_perplexity_equals_a_hand_computation(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompts=PROMPTS)
    logits = forward(model, batch).logits
    scores = Scores(["perplexity"])
    scores.update(logits, batch.labels, logits)
    nll = []
    for row, length in enumerate(batch.lengths):  # real tokens only: each predicted from the real one before it
        ids, z = batch.input_ids[row, -length:], logits[row, -length:].double().log_softmax(-1)
        nll += [-z[t, ids[t + 1]] for t in range(length - 1)]
    assert scores.result()["perplexity"] == pytest.approx(math.exp(float(sum(nll)) / len(nll)), rel=1e-12)
    single = encode_prompts(tok, prompt=PROMPTS[0])  # and transformers' own loss, where nothing is padded
    loss = forward(model, single, labels=single.labels).loss
    one = Scores(["perplexity"])
    one.update(forward(model, single).logits, single.labels, logits)
    assert one.result()["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_logit_diff_equals_the_logit_difference_at_the_last_position(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompts=PROMPTS)
    logits = forward(model, batch).logits
    cat, dog = tok.convert_tokens_to_ids(["cat", "dog"])
    scores = Scores([logit_diff(tok, "cat", "dog")])
    scores.update(logits, batch.labels, logits)
    hand = [float(logits[b, -1, cat].double() - logits[b, -1, dog].double()) for b in range(2)]
    assert scores.result()["logit_diff"] == pytest.approx(sum(hand) / 2, rel=1e-12)
    right_padded = torch.tensor([[5, 6, 7], [5, -100, -100]])
    assert last_positions(logits[:, :3], right_padded).tolist() == [2, 0]


def test_lm_metrics_through_evaluate_with_and_without_a_surgery(lm: tuple[nn.Module, Any]) -> None:
    model, tok = lm
    batch = encode_prompts(tok, prompt=PROMPTS[0])  # one unpadded prompt: evaluate feeds input_ids alone
    chosen = text_metrics(["perplexity", {"logit_diff": {"correct": "cat", "wrong": "dog"}}], tok)
    got = surgery.evaluate(model, [(batch.input_ids, batch.labels)], ZERO_MLP, metrics=chosen)
    with surgery.apply(model, ZERO_MLP):
        after = forward(model, batch).logits
    before = forward(model, batch).logits
    for logits, key in ((after, "surgered"), (before, "unmodified")):
        scores = Scores(chosen)
        scores.update(logits, batch.labels, before)
        assert got[key] == scores.result()
    assert got["delta"]["perplexity"] == got["surgered"]["perplexity"] - got["unmodified"]["perplexity"]


@pytest.mark.parametrize(
    ("correct", "message"),
    [
        ("the cat", "metrics.logit_diff.correct: 'the cat' is 2 tokens ['the', 'cat']"),
        ("zebra", "metrics.logit_diff.correct: 'zebra' is not in the tokenizer's vocabulary"),
        ("", "metrics.logit_diff.correct: a text that is one token"),
    ],
)
def test_logit_diff_texts_must_be_one_token(lm: tuple[nn.Module, Any], correct: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        logit_diff(lm[1], correct, "dog")
    assert str(info.value).startswith(message)


def test_bare_or_misconfigured_logit_diff_is_refused(lm: tuple[nn.Module, Any]) -> None:
    logits = torch.zeros(1, 3, 4)
    with pytest.raises(ConfigError, match=r"^metrics\.logit_diff: needs its two answers"):
        Scores(["logit_diff"]).update(logits, None, logits)
    with pytest.raises(ConfigError, match=r"^metrics\[0\]\.logit_diff: needs \{correct: TEXT, wrong: TEXT\}"):
        text_metrics([{"logit_diff": {"correct": "cat"}}], lm[1])
    with pytest.raises(ConfigError, match=r"^metrics\.logit_diff\.wrong: 'a dog' is 2 tokens"):
        text_metrics({"logit_diff": {"correct": "cat", "wrong": "a dog"}}, lm[1])
