"""Rough edges a researcher hit (issue 39): each fails on the code before the fix.

A noise action's stream can be given a seed a hand script reproduces; the documented
``save_file(s.take_streamed(), path)`` works on GPT-2 block inputs (position ids shared by every
block); a prompt that gives no tokens names the tokenizer class and the override that reads the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import surgery
from surgery.actions.base import seed_for
from surgery.actions.noise import noise_stream
from surgery.errors import ConfigError
from surgery.lm.text import encode_prompts
from tests.lm_helpers import tiny_gpt2


def test_a_noise_seed_gives_the_stream_a_hand_script_draws() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        plain = model(x)
        with surgery.apply(model, {"n": {"kind": "modify_output", "select": "0", "op": "noise", "std": 0.5,
                                         "seed": 1234}}):  # fmt: skip
            noised = model(x)
        draw = noise_stream(1234, 0.5)
        assert torch.equal(noised, plain + draw(plain))
        with surgery.apply(model, {"n": {"kind": "modify_output", "select": "0", "op": "noise", "std": 0.5}}):
            derived = model(x)
        assert torch.equal(derived, plain + noise_stream(seed_for(0, "n"), 0.5)(plain))  # the documented default


@pytest.mark.parametrize(("seed", "op"), [(-1, "noise"), (2**63, "noise"), (True, "noise"), (3, "add")])
def test_a_bad_noise_seed_is_refused(seed, op) -> None:
    action = {"kind": "modify_output", "select": "0", "op": op, "std": 1.0, "value": 1.0, "seed": seed}
    with pytest.raises(ConfigError, match=r"^actions.n.seed: "):
        surgery.plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"n": action})


def test_the_documented_save_file_of_take_streamed_works_on_gpt2_block_inputs(tmp_path: Path) -> None:
    model = tiny_gpt2(20, 1)
    ids = torch.randint(2, 20, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), surgery.apply(model, {"c": {"kind": "capture", "select": "transformer.h.*",
                                                      "what": ["input"], "to": "disk"}}) as s:  # fmt: skip
        model(ids)
        taken = s.take_streamed()
        save_file(taken, str(tmp_path / "inputs.safetensors"))
    back = load_file(str(tmp_path / "inputs.safetensors"))
    assert set(back) == set(taken) and all(torch.equal(back[k], taken[k]) for k in taken)


def test_a_prompt_without_tokens_names_the_tokenizer_class_and_the_override() -> None:
    class SilentTokenizer:
        pad_token_id = 0

        def __call__(self, text: str, **kw):
            return {"input_ids": []}

    with pytest.raises(ConfigError) as caught:
        encode_prompts(SilentTokenizer(), prompt="The cat sat")
    assert "(SilentTokenizer)" in str(caught.value) and "input.tokenizer=DIR/tokenizer.json" in str(caught.value)


def test_a_tokenizer_whose_regex_panics_in_rust_is_one_line_and_prints_no_backtrace(capfd) -> None:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "[PAD]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+$"), behavior="isolated")  # backtracks past onig's limit
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]")
    with pytest.raises(ConfigError, match=r"^input.prompt: the tokenizer \(\w+\) failed inside its native library"):
        encode_prompts(tok, prompt="a" * 40 + "!")
    assert "panicked" not in capfd.readouterr().err  # Rust's own report went nowhere


def test_an_attention_pattern_plot_is_labelled_by_the_prompts_tokens() -> None:
    from surgery.app.plots import figure_of

    pattern = torch.softmax(torch.randn(1, 2, 3, 3), -1)  # [batch, heads, query, key]
    fig = figure_of(pattern, "capture · transformer.h.0.attn · output.1", tokens=["<bos>", " w3", " w17"])
    first = fig.axes[0]
    assert [t.get_text() for t in first.get_xticklabels()] == ["<bos>", " w3", " w17"]
    assert [t.get_text() for t in first.get_yticklabels()] == ["<bos>", " w3", " w17"]
    assert first.get_title().startswith("head 0")
    other = figure_of(torch.randn(1, 2, 4, 4), "not a pattern of this prompt", tokens=["a", "b", "c"])
    assert not other.axes[0].get_xticklabels()  # a map of another size keeps no labels
