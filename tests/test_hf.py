"""The transformer recipes on tiny GPT-2 and BERT: each equals the same hooks written by hand in PyTorch."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch import nn  # noqa: E402

import surgery  # noqa: E402
from surgery.app.job import run_job  # noqa: E402
from surgery.core.paths import config_dir  # noqa: E402
from surgery.errors import ConfigError  # noqa: E402
from surgery.models.hf import bert_tiny, gpt2_tiny  # noqa: E402
from tests.conftest import Snapshot  # noqa: E402
from tests.exact_runs import job_of, max_abs, scale_item0, with_hooks, zero_output  # noqa: E402
from tests.exact_runs import logits as job_logits  # noqa: E402

FACTORIES = {"gpt2_tiny": gpt2_tiny, "bert_tiny": bert_tiny}
MATCHES = {  # (recipe, model) -> the modules the recipe must select, in model order
    ("ablate_mlp", "gpt2_tiny"): ["transformer.h.0.mlp", "transformer.h.1.mlp"],
    ("ablate_mlp", "bert_tiny"): ["bert.encoder.layer.0.output.dense", "bert.encoder.layer.1.output.dense"],
    ("capture_residual", "gpt2_tiny"): ["transformer.h.0", "transformer.h.1"],
    ("capture_residual", "bert_tiny"): ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    ("scale_attention", "gpt2_tiny"): ["transformer.h.0.attn", "transformer.h.1.attn"],
    ("scale_attention", "bert_tiny"): ["bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.attention.self"],
}

Hook = Callable[[nn.Module, tuple[Any, ...], Any], Any]


def build(name: str) -> nn.Module:
    """The tiny model as the CLI builds it: seeded first."""
    torch.manual_seed(0)
    return FACTORIES[name]()


def tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))


def recipe(name: str) -> dict[str, Any]:
    """A shipped actions file as a plain dict, to change a value the way an override would."""
    return OmegaConf.to_container(OmegaConf.load(config_dir() / "actions" / f"{name}.yaml"))  # type: ignore[return-value]


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


@contextmanager
def by_hand(model: nn.Module, names: list[str], hook: Hook) -> Iterator[None]:
    """The reference: ``hook`` registered with plain PyTorch on each named module, removed after."""
    handles = [model.get_submodule(n).register_forward_hook(hook) for n in names]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize(("name", "model_name"), sorted(MATCHES))
def test_each_recipe_selects_the_modules_meant(name: str, model_name: str) -> None:
    model = build(model_name)
    assert surgery.plan(model, name).to_dict()[0]["matched"] == MATCHES[name, model_name]


@pytest.mark.parametrize("model_name", sorted(FACTORIES))
def test_ablate_mlp_equals_zeroing_hooks_by_hand(model_name: str) -> None:
    model, x = build(model_name), tokens()
    clean = logits(model, x)
    with by_hand(model, MATCHES["ablate_mlp", model_name], lambda m, args, out: torch.zeros_like(out)):
        expected = logits(model, x)
    before = Snapshot.of(model)
    with surgery.apply(model, "ablate_mlp"):
        got = logits(model, x)
    before.assert_same(model)
    assert torch.equal(got, expected)
    assert not torch.equal(got, clean)
    assert torch.equal(logits(model, x), clean)


@pytest.mark.parametrize("model_name", sorted(FACTORIES))
def test_capture_residual_equals_capturing_by_hand_and_the_hidden_states(model_name: str) -> None:
    model, x = build(model_name), tokens()
    names = MATCHES["capture_residual", model_name]
    expected: dict[str, torch.Tensor] = {}

    def store(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        expected[next(n for n in names if model.get_submodule(n) is m)] = out.detach()

    with by_hand(model, names, store):
        clean = logits(model, x)
    with torch.no_grad():
        hidden = model(x, output_hidden_states=True).hidden_states
    before = Snapshot.of(model)
    with surgery.apply(model, "capture_residual") as s:
        assert torch.equal(logits(model, x), clean)  # capturing changes nothing
        records = s.captures["capture_residual"]
    before.assert_same(model)
    assert list(records) == names
    for i, name in enumerate(names):
        assert len(records[name].calls) == 1
        assert torch.equal(records[name].output, expected[name])
        assert records[name].output.shape == (2, 16, 32)
        if model_name == "gpt2_tiny" and i == len(names) - 1:  # GPT-2's last hidden state is after ln_f
            assert not torch.equal(records[name].output, hidden[i + 1])
        else:
            assert torch.equal(records[name].output, hidden[i + 1])


def test_gpt2_last_block_output_is_the_last_hidden_state_before_the_final_layer_norm() -> None:
    model, x = build("gpt2_tiny"), tokens()
    with surgery.apply(model, "capture_residual") as s, torch.no_grad():
        hidden = model(x, output_hidden_states=True).hidden_states
        last = s.captures["capture_residual"]["transformer.h.1"].output
    assert torch.equal(model.transformer.ln_f(last), hidden[-1])


@pytest.mark.parametrize("model_name", sorted(FACTORIES))
def test_scale_attention_equals_scaling_item_0_by_hand(model_name: str) -> None:
    model, x = build(model_name), tokens()
    clean = logits(model, x)
    with by_hand(model, MATCHES["scale_attention", model_name], lambda m, args, out: (out[0] * 0.5, *out[1:])):
        expected = logits(model, x)
    before = Snapshot.of(model)
    with surgery.apply(model, "scale_attention"):
        got = logits(model, x)
    before.assert_same(model)
    assert torch.equal(got, expected)
    assert not torch.equal(got, clean)

    unchanged = recipe("scale_attention")
    unchanged["scale_attention"]["value"] = 1.0
    with surgery.apply(model, unchanged):
        assert torch.equal(logits(model, x), clean)
    before.assert_same(model)


def test_gpt2_without_attention_and_mlp_is_the_embeddings_through_the_head() -> None:
    model, x = build("gpt2_tiny"), tokens()
    actions = {**recipe("scale_attention"), **recipe("ablate_mlp")}
    actions["scale_attention"]["value"] = 0.0
    with torch.no_grad():
        positions = torch.arange(x.shape[1])
        embeddings_only = model.lm_head(
            model.transformer.ln_f(model.transformer.wte(x) + model.transformer.wpe(positions))
        )
    before = Snapshot.of(model)
    with surgery.apply(model, actions) as s:
        got = logits(model, x)
        assert s.hook_count == {"scale_attention": 2, "ablate_mlp": 2}
    before.assert_same(model)
    torch.testing.assert_close(got, embeddings_only, rtol=0, atol=1e-6)
    assert (got - logits(model, x)).abs().max() > 1e-3


def test_the_same_seed_builds_the_same_weights_and_no_hub_is_reached() -> None:
    import os

    for name in FACTORIES:
        a, b = build(name).state_dict(), build(name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        torch.manual_seed(1)
        assert not torch.equal(FACTORIES[name]().state_dict()[next(iter(a))], next(iter(a.values())))
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert not build("gpt2_tiny").training and build("gpt2_tiny").config._attn_implementation == "eager"


def test_without_transformers_the_factory_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ConfigError, match=r"^model: this model needs the optional extra: pip install 'surgery\[hf\]'$"):
        gpt2_tiny()


# ---------------------------------------------------------------- the CLI's job on the shipped configs


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_cli_job_gpt2_runs_every_recipe_with_backward(tmp_path: Path) -> None:
    actions = "+actions=[capture_residual,ablate_mlp,scale_attention]"
    report = run_job(composed("+model=gpt2_tiny", actions, "backward=true"), tmp_path)
    assert [(step["action"], step["matched"], step["hooks"]) for step in report["plan"]] == [
        (name, MATCHES[name, "gpt2_tiny"], 2) for name in ("capture_residual", "ablate_mlp", "scale_attention")
    ]
    assert report["input"] == [{"shape": [2, 16], "dtype": "int64"}]  # token ids stay ints, even with backward
    assert report["output"]["shape"] == [2, 16, 100]
    assert report["difference"]["comparable"]
    assert report["difference"]["max_abs"] == hand_surgered_max_abs(
        ("+model=gpt2_tiny", "backward=true"), "transformer.h.{}.mlp", "transformer.h.{}.attn"
    )
    from safetensors.torch import load_file

    captures = load_file(str(tmp_path / "captures.safetensors"))
    assert sorted(captures) == ["capture_residual/transformer.h.0/output", "capture_residual/transformer.h.1/output"]


def test_cli_job_bert_runs_its_recipes_and_follows_the_vocab_size(tmp_path: Path) -> None:
    actions = "+actions=[capture_residual,ablate_mlp,scale_attention]"
    report = run_job(composed("+model=bert_tiny", actions, "backward=true", "model.vocab_size=50"), tmp_path)
    assert [(step["action"], step["matched"], step["hooks"]) for step in report["plan"]] == [
        (name, MATCHES[name, "bert_tiny"], 2) for name in ("capture_residual", "ablate_mlp", "scale_attention")
    ]
    assert report["output"]["shape"] == [2, 16, 50]  # token ids were drawn below the new vocab size
    assert report["difference"]["max_abs"] == hand_surgered_max_abs(
        ("+model=bert_tiny", "backward=true", "model.vocab_size=50"),
        "bert.encoder.layer.{}.output.dense",
        "bert.encoder.layer.{}.attention.self",
    )


def hand_surgered_max_abs(overrides: tuple[str, ...], mlp: str, attention: str) -> float:
    """ablate_mlp and scale_attention (0.5) on blocks 0 and 1 as hand-written hooks: the report's max |change|."""
    model, x = job_of(*overrides)
    original = job_logits(model, x)
    hooks = {mlp.format(i): zero_output for i in (0, 1)} | {attention.format(i): scale_item0(0.5) for i in (0, 1)}
    handles = with_hooks(model, hooks)
    surgered = job_logits(model, x)
    for handle in handles:
        handle.remove()
    return max_abs(surgered, original)
