"""Steering vectors as config (SPEC §20): contrastive means read through a capture action, added by
``vector: NAME`` actions, each compared with the same thing written with plain forward hooks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import surgery  # noqa: E402
import surgery.vectors as vectors  # noqa: E402
from surgery.app.job import run_job  # noqa: E402
from surgery.errors import ConfigError  # noqa: E402
from surgery.lm.load import load_pretrained  # noqa: E402
from surgery.lm.text import encode_prompts, load_tokenizer  # noqa: E402
from tests.lm_helpers import tiny_gpt2, trimmed, word_tokenizer  # noqa: E402
from tests.test_cli import cli, composed  # noqa: E402

SENTENCES = ["the cat sat on the mat", "the dog ran in the park", "I love it and I hate it a lot"]
PLUS = ["I love it", "the cat sat on the mat", "love it"]  # different lengths: left padding is exercised
MINUS = ["I hate it a lot", "the dog ran", "hate it"]
PROMPTS = ["the cat sat on the", "a dog ran"]


@pytest.fixture(scope="module")
def tok() -> Any:
    return word_tokenizer(SENTENCES)


@pytest.fixture(scope="module")
def gpt2(tok: Any) -> torch.nn.Module:
    return tiny_gpt2(len(tok), tok.eos_token_id, initializer_range=0.5)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory, tok: Any) -> Path:
    path = tmp_path_factory.mktemp("gpt2-vectors")
    tiny_gpt2(len(tok), tok.eos_token_id, initializer_range=0.5).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def hand_rows(model: Any, tok: Any, block: torch.nn.Module, prompts: list[str], pos: int | str,
              side: str = "output") -> torch.Tensor:  # fmt: skip
    """The block's output (or input) per prompt at ``pos`` (or its mean over real tokens), with a plain hook."""
    batch = encode_prompts(tok, prompts=prompts)
    store: dict[str, torch.Tensor] = {}
    if side == "output":
        handle = block.register_forward_hook(
            lambda m, a, o: store.__setitem__("x", o[0] if isinstance(o, tuple) else o)
        )
    else:
        handle = block.register_forward_pre_hook(
            lambda m, a, k: store.__setitem__("x", a[0] if a else k["hidden_states"]), with_kwargs=True
        )
    with torch.no_grad():
        model(**batch.kwargs())
    handle.remove()
    x, tokens = store["x"], batch.input_ids.shape[1]
    rows = []
    for i, n in enumerate(batch.lengths):
        if pos == "mean":
            rows.append(x[i, tokens - n :].mean(dim=0))
        else:
            assert isinstance(pos, int)
            rows.append(x[i, tokens + pos] if pos < 0 else x[i, tokens - n + pos])
    return torch.stack(rows)


def hand_vector(model: Any, tok: Any, block: torch.nn.Module, pos: int | str, side: str = "output") -> torch.Tensor:
    return hand_rows(model, tok, block, PLUS, pos, side).mean(dim=0) - hand_rows(model, tok, block, MINUS, pos,
                                                                                  side).mean(dim=0)  # fmt: skip


@pytest.mark.parametrize("pos", [-1, -2, 0, 1, "mean"])
def test_the_contrastive_mean_equals_plain_hooks_bit_for_bit(gpt2: Any, tok: Any, pos: int | str) -> None:
    got = vectors.contrast(gpt2, tok, site="@resid_post.1", plus=PLUS, minus=MINUS, pos=pos)
    assert torch.equal(got, hand_vector(gpt2, tok, gpt2.transformer.h[1], pos))
    pre = vectors.contrast(gpt2, tok, site="@resid_pre.1", plus=PLUS, minus=MINUS, pos=pos)
    assert torch.equal(pre, hand_vector(gpt2, tok, gpt2.transformer.h[1], pos, side="input"))


def steered_logits(model: Any, tok: Any, hook: Any, **options: Any) -> torch.Tensor:
    batch = encode_prompts(tok, prompts=PROMPTS)
    handle = model.transformer.h[0].register_forward_hook(hook) if hook is not None else None
    try:
        with torch.no_grad():
            return model(**batch.kwargs(), **{"use_cache": False, **options}).logits
    finally:
        if handle is not None:
            handle.remove()


def add_at_last(vector: torch.Tensor, scale: float, pos: int = -1) -> Any:
    def hook(m: Any, a: Any, o: torch.Tensor) -> torch.Tensor:
        o = o.clone()
        o[:, pos] = o[:, pos] + scale * vector
        return o

    return hook


def test_steering_with_scale_gives_the_logits_of_a_hook_adding_scale_times_the_vector(gpt2: Any, tok: Any) -> None:
    v = vectors.contrast(gpt2, tok, site="@resid_post.0", plus=PLUS, minus=MINUS)
    steer = {"kind": "modify_output", "select": "@resid_post.0", "vector": "love", "scale": 4, "index": "[:, -1]"}
    batch = encode_prompts(tok, prompts=PROMPTS)
    with surgery.apply(gpt2, vectors.steering({"steer": steer}, {"love": v})), torch.no_grad():
        got = gpt2(**batch.kwargs(), use_cache=False).logits
    assert torch.equal(got, steered_logits(gpt2, tok, add_at_last(v, 4.0)))
    assert not torch.equal(got, steered_logits(gpt2, tok, None))
    whole = {**steer, "vector": v, "scale": 0.5}  # a tensor given as vector; no index: every position
    del whole["index"]
    with surgery.apply(gpt2, vectors.steering({"steer": whole})), torch.no_grad():
        got = gpt2(**batch.kwargs(), use_cache=False).logits
    assert torch.equal(got, steered_logits(gpt2, tok, lambda m, a, o: o + 0.5 * v))


def test_a_study_over_coef_and_positions_equals_the_hand_loop(gpt2: Any, tok: Any) -> None:
    v = vectors.contrast(gpt2, tok, site="@resid_post.0", plus=PLUS, minus=MINUS)
    steer = {"kind": "modify_output", "select": "@resid_post.0", "vector": "love", "scale": "{coef}",
             "index": "[:, {pos}]"}  # fmt: skip
    batch = encode_prompts(tok, prompts=PROMPTS)
    love = tok("love")["input_ids"][0]
    grid = {"coef": [0.0, 2.0, 4.0], "pos": [-1, -2]}
    result = surgery.study(gpt2, vectors.steering({"steer": steer}, {"love": v}), grid, batch.kwargs(),
                           [{"logit": {"token": love}}], batch_cells=1)  # fmt: skip
    for i, coef in enumerate(grid["coef"]):
        for j, pos in enumerate(grid["pos"]):
            hook = add_at_last(v, coef, pos)  # a study's forward fills the cache, as model(**batch) does
            expected = steered_logits(gpt2, tok, hook, use_cache=True)[:, -1, love].double()
            assert torch.equal(result.values["logit"][i, j], expected), (coef, pos)


def test_mode_generate_steers_like_a_hand_hooked_generate(lm_dir: Path, tmp_path: Path) -> None:
    spec = f"{{site: '@resid_post.0', plus: {{prompts: {json.dumps(PLUS)}}}, minus: {{prompts: {json.dumps(MINUS)}}}}}"
    steer = "+actions.steer={kind: modify_output, select: '@resid_post.0', vector: love, scale: 8, index: '[:, -1]'}"
    cfg = composed("+model=hf", f"model.path={lm_dir}", "mode=generate", "generate.max_new_tokens=6",
                   "+input.prompt=the cat sat", f"+vectors.love={spec}", steer)  # fmt: skip
    report = run_job(cfg, tmp_path)
    model, tok = load_pretrained(lm_dir), load_tokenizer(model_path=lm_dir)
    v = hand_vector(model, tok, model.transformer.h[0], -1)
    batch = encode_prompts(tok, prompt="the cat sat")
    handle = model.transformer.h[0].register_forward_hook(add_at_last(v, 8.0))
    try:
        with torch.no_grad():
            out = model.generate(**batch.kwargs(), max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    finally:
        handle.remove()
    row = report["generate"]["prompts"][0]
    assert row["surgered_tokens"] == trimmed(out, batch.input_ids.shape[1], tok.eos_token_id)[0]
    assert row["surgered_tokens"] != row["unmodified_tokens"]
    assert torch.equal(load_file(str(tmp_path / "vectors.safetensors"))["love"], v)


def test_a_run_writes_vectors_safetensors_and_lists_them_in_the_report(lm_dir: Path, tmp_path: Path) -> None:
    rows = torch.randn(3, 32)
    save_file({"mean": rows[0].clone(), "rows": rows}, str(tmp_path / "sides.safetensors"))
    spec = f"{{site: '@resid_post.1', plus: {{prompts: {json.dumps(PLUS)}}}, minus: {{prompts: {json.dumps(MINUS)}}}}}"
    files = f"{{plus: {{file: {tmp_path / 'sides.safetensors'}, key: rows}}}}"
    steer = "+actions.steer={kind: modify_output, select: '@resid_post.1', vector: love, scale: 2}"
    out = tmp_path / "run"
    cfg = composed("+model=hf", f"model.path={lm_dir}", "+input.prompt=the cat sat", f"+vectors.love={spec}",
                   f"+vectors.given={files}", steer)  # fmt: skip
    report = run_job(cfg, out)
    model, tok = load_pretrained(lm_dir), load_tokenizer(model_path=lm_dir)
    saved = load_file(str(out / "vectors.safetensors"))
    assert torch.equal(saved["love"], hand_vector(model, tok, model.transformer.h[1], -1))
    assert torch.equal(saved["given"], rows.mean(dim=0))  # [n, d] rows are averaged
    listed = {v["name"]: v for v in report["vectors"]}
    assert listed["love"]["site"] == "@resid_post.1" and listed["love"]["module"] == "transformer.h.1"
    assert listed["love"]["examples"] == {"plus": 3, "minus": 3}
    assert listed["love"]["norm"] == pytest.approx(float(saved["love"].double().norm()))
    assert listed["given"]["examples"] == {"plus": 3} and listed["given"]["site"] is None
    assert json.loads((out / "report.json").read_text())["vectors"] == report["vectors"]


def test_safe_mode_takes_a_vector_surgery_computed_and_still_refuses_python_tensors(tmp_path: Path, gpt2: Any) -> None:
    sides = "plus: {prompts: ['w1 w2 w25', 'w3 w25']}, minus: {prompts: ['w1 w2 w60', 'w3 w60']}"
    steer = "+actions.steer={kind: modify_output, select: '@resid_post.1', vector: w25, scale: 2}"
    cfg = composed("+model=induction_lm", f"+vectors.w25={{site: '@resid_post.1', {sides}}}", steer, "safe=true")
    checkout = Path(surgery.__file__).parent.parent  # started in the checkout: the shipped weights are inside
    report = run_job(cfg, tmp_path, set(), checkout)
    assert report["difference"]["max_abs"] > 0 and report["vectors"][0]["examples"] == {"plus": 2, "minus": 2}
    given = {"kind": "modify_output", "select": "@resid_post.1", "vector": torch.ones(32)}
    with pytest.raises(ConfigError, match=r"^actions\.steer\.value: a Python tensor is refused because safe=true"):
        surgery.plan(gpt2, vectors.steering({"steer": given}), safe=True)


def test_a_vector_that_does_not_fit_the_module_is_refused_at_plan_time(lm_dir: Path, tmp_path: Path) -> None:
    save_file({"v": torch.ones(16)}, str(tmp_path / "v.safetensors"))
    cfg = composed("+model=hf", f"model.path={lm_dir}", "+input.prompt=the cat sat",
                   f"+vectors.narrow={{plus: {{file: {tmp_path / 'v.safetensors'}, key: v}}}}",
                   "+actions.s={kind: modify_output, select: '@resid_post.1', vector: narrow}")  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        run_job(cfg, tmp_path / "run")
    assert str(caught.value) == (
        "actions.s.vector: the vector has shape [16], but the output of 'transformer.h.1' is [1, 3, 32] on this"
        " input: it does not broadcast onto it"
    )


BAD = [  # (overrides, the start of the one-line message)
    (["+actions.s={kind: modify_output, select: '@resid_post.1', vector: lvoe}"],
     r"actions\.s\.vector: 'lvoe' names no vector\. Did you mean 'love'\?"),
    (["+actions.s={kind: modify_output, select: '@resid_post.1', vector: love, op: mul}"],
     r"actions\.s\.op: a vector is added \(op: add"),
    (["+actions.s={kind: modify_output, select: '@resid_post.1', vector: love, value: 1.0}"],
     r"actions\.s\.value: vector gives the tensor to add; drop value"),
    (["vectors.love.site='@resid_post'"], r"vectors\.love\.site: '@resid_post' resolves to 2 modules"),
    (["vectors.love.site='transformer.h.9'"], r"vectors\.love\.site: "),
    (["++vectors.love.pos=7"],
     r"vectors\.love\.pos: 7 is outside the prompt 'I love it' of 3 token\(s\) \(positions -3 to 2\)$"),
    (["++vectors.love.pos=last"], r"vectors\.love\.pos: a position \(an int"),
    (["+vectors.love.minsu=1"], r"vectors\.love\.minsu: unknown key\. Did you mean 'minus'\?"),
    (["~vectors.love.plus"], r"vectors\.love\.plus: required"),
    (["vectors.love.plus={prompts: []}"], r"vectors\.love\.plus\.prompts: a non-empty list"),
    (["++vectors.love.plus={file: nothere.safetensors}"], r"vectors\.love\.plus: give prompts or file \(with key\)"),
    (["~vectors.love.minus", "+vectors.love.minus={file: no.safetensors}"], r"vectors\.love\.minus\.key: a file side"),
    (["~vectors.love.minus", "+vectors.love.minus={file: no.safetensors, key: v}"],
     r"vectors\.love\.minus\.file: "),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_bad_vector_configs_are_refused_in_one_line_naming_the_key(
    lm_dir: Path, tmp_path: Path, overrides: list[str], message: str
) -> None:
    spec = f"{{site: '@resid_post.1', plus: {{prompts: {json.dumps(PLUS)}}}, minus: {{prompts: {json.dumps(MINUS)}}}}}"
    base = ["+model=hf", f"model.path={lm_dir}", "+input.prompt=the cat sat", f"+vectors.love={spec}"]
    if not any(o.startswith("+actions") for o in overrides):
        base.append("+actions.s={kind: modify_output, select: '@resid_post.1', vector: love}")
    with pytest.raises(ConfigError, match=f"^{message}") as caught:
        run_job(composed(*base, *overrides), tmp_path)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "vectors.safetensors").exists()


def test_a_vector_left_as_a_name_in_python_is_refused_naming_steering(gpt2: Any) -> None:
    steer = {"kind": "modify_output", "select": "@resid_post.1", "op": "add", "vector": "love"}
    with pytest.raises(ConfigError, match=r"^actions\.s\.vector: 'love' is not a vector here.*vectors\.steering"):
        surgery.plan(gpt2, {"s": steer})


def test_the_cli_exits_2_on_a_vector_naming_no_vector(lm_dir: Path, tmp_path: Path) -> None:
    result = cli("+model=hf", f"model.path={lm_dir}", "+input.prompt=the cat sat",
                 "+actions.s={kind: modify_output, select: '@resid_post.1', vector: love}", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: actions.s.vector: 'love' names no vector. Vectors of this run: none (the top-level vectors: block,"
        " docs/vectors.md)"
    )


def test_a_grouped_query_llama_reads_the_site_and_the_vector_matches_hooks(tok: Any) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=tok.eos_token_id)  # fmt: skip
    config._attn_implementation = "eager"
    llama = transformers.LlamaForCausalLM(config).eval()
    got = vectors.contrast(llama, tok, site="@resid_post.1", plus=PLUS, minus=MINUS, pos=-1)
    assert torch.equal(got, hand_vector(llama, tok, llama.model.layers[1], -1))
    pre = vectors.contrast(llama, tok, site="@resid_pre.0", plus=PLUS, minus=MINUS, pos="mean")
    assert torch.equal(pre, hand_vector(llama, tok, llama.model.layers[0], "mean", side="input"))
    steer = {"kind": "modify_output", "select": "@resid_post.1", "vector": got, "scale": 3.0, "index": "[:, -1]"}
    batch = encode_prompts(tok, prompts=PROMPTS)
    with surgery.apply(llama, vectors.steering({"steer": steer})), torch.no_grad():
        steered = llama(**batch.kwargs(), use_cache=False).logits
    handle = llama.model.layers[1].register_forward_hook(add_at_last(got, 3.0))
    with torch.no_grad():
        expected = llama(**batch.kwargs(), use_cache=False).logits
    handle.remove()
    assert torch.equal(steered, expected)


def test_the_shipped_steer_experiment_makes_the_induction_model_say_w25(tmp_path: Path) -> None:
    report = run_job(composed("+experiment=steer"), tmp_path)
    rows = report["generate"]["prompts"]
    assert [r["unmodified"].split()[0] for r in rows] == ["w60", "w60", "w33"]
    assert [r["surgered"].split()[0] for r in rows] == ["w25", "w25", "w25"]
    assert report["vectors"][0]["examples"] == {"plus": 4, "minus": 4}
    assert set(load_file(str(tmp_path / "vectors.safetensors"))) == {"w25"}


def test_a_data_side_reads_its_texts_and_gives_the_vector_of_the_same_prompts(
    gpt2: Any, tok: Any, tmp_path: Path
) -> None:
    from surgery.vectors.contrast import compute_vectors

    (tmp_path / "plus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in PLUS))
    (tmp_path / "minus.txt").write_text("\n".join(MINUS) + "\n")
    (tmp_path / "folder").mkdir()
    for i, text in enumerate(MINUS):
        (tmp_path / "folder" / f"{i}.txt").write_text(text)
    want = vectors.contrast(gpt2, tok, site="@resid_post.1", plus=PLUS, minus=MINUS, pos=-1)
    for minus in (str(tmp_path / "minus.txt"), str(tmp_path / "folder")):
        block = {
            "v": {"site": "@resid_post.1", "plus": {"data": str(tmp_path / "plus.jsonl")}, "minus": {"data": minus}}
        }
        assert torch.equal(compute_vectors(gpt2, block, tok)["v"].tensor, want)
    limited = {"v": {"site": "@resid_post.1", "plus": {"data": str(tmp_path / "plus.jsonl"), "limit": 1}}}
    assert torch.equal(compute_vectors(gpt2, limited, tok)["v"].tensor,
                       vectors.contrast(gpt2, tok, site="@resid_post.1", plus=PLUS[:1], pos=-1))  # fmt: skip
    (tmp_path / "bad.jsonl").write_text('{"other": "x"}\n')
    with pytest.raises(ConfigError, match=r"^vectors.v.plus.column: .* line 1 has no text 'text'"):
        compute_vectors(gpt2, {"v": {"site": "@resid_post.1", "plus": {"data": str(tmp_path / "bad.jsonl")}}}, tok)
