"""The run setting ``limits`` and surgery/core/limits.py: validation, defaults, messages, the meta measure."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from surgery.app.build import settings_of
from surgery.core.limits import (
    GB,
    SAFE_DEFAULTS,
    UNBOUNDED,
    Limits,
    active,
    check_built,
    check_count,
    check_memory,
    count_refusal,
    enforced,
)
from surgery.core.schema import check_limits, limits_of
from surgery.errors import ConfigError
from tests.test_cli import cli, composed

# ---------------------------------------------------------------- the run setting


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("limits.memory_gb=abc", r"^limits\.memory_gb: 'abc' is not a positive number \(or null for the default\)$"),
        ("limits.memory_gb=-1", r"^limits\.memory_gb: -1 is not a positive number"),
        ("limits.memory_gb=0", r"^limits\.memory_gb: 0 is not a positive number"),
        ("limits.disk_gb=true", r"^limits\.disk_gb: True is not a positive number"),
        ("limits.count=[1]", r"^limits\.count: \[1\] is not a positive number"),
        (
            "+limits.memory=1",
            r"^limits\.memory: unknown key\. Did you mean 'memory_gb'\? Keys here: memory_gb, disk_gb, count\.$",
        ),
        ("limits=5", r"^limits: expected a mapping"),
    ],
)
def test_a_bad_limit_is_one_line_naming_its_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        settings_of(composed("+model=mlp", override))
    assert "\n" not in str(caught.value)


def test_cli_bad_limit_is_exit_2_with_one_line(tmp_path: Path) -> None:
    result = cli("+model=mlp", "limits.memory_gb=abc", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: limits.memory_gb: 'abc' is not a positive number (or null for the default)"
    ]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], UNBOUNDED),
        (["safe=true"], SAFE_DEFAULTS),
        (["safe=true", "limits.memory_gb=17"], Limits(17, 8.0, 10_000, paths_inside=True)),
        (["safe=true", "limits.count=5", "limits.disk_gb=0.5"], Limits(8.0, 0.5, 5, paths_inside=True)),
        (["limits.memory_gb=2"], Limits(memory_gb=2)),
        (["limits.count=3"], Limits(count=3)),
    ],
)
def test_limits_of_a_run_are_safe_defaults_under_safe_and_what_is_set(overrides: list[str], expected: Limits) -> None:
    assert limits_of(settings_of(composed("+model=mlp", *overrides))) == expected


def test_the_shipped_config_leaves_every_limit_null_and_documented() -> None:
    cfg = composed()
    assert dict(cfg.limits) == {"memory_gb": None, "disk_gb": None, "count": None}
    check_limits(dict(cfg.limits))


# ---------------------------------------------------------------- enforcing


def test_nothing_is_bounded_outside_enforced_and_enforced_nests() -> None:
    assert active() == UNBOUNDED
    check_memory(10**20, "x")
    check_count(10**20, "x", "things")
    with enforced(SAFE_DEFAULTS):
        assert active() == SAFE_DEFAULTS
        with enforced(Limits(count=1)):
            assert active().count == 1
        assert active() == SAFE_DEFAULTS
    assert active() == UNBOUNDED


@pytest.mark.parametrize("nbytes", [8 * GB + 1, 9.5 * GB, 3.7e15, 123456789012345])
def test_a_memory_refusal_suggests_a_limit_that_admits_it(nbytes: float) -> None:
    with enforced(SAFE_DEFAULTS), pytest.raises(ConfigError) as caught:
        check_memory(nbytes, "actions.r.with", "a thing")
    message = str(caught.value)
    assert message.startswith("actions.r.with: would need ") and "(a thing), more than limits.memory_gb=8;" in message
    key, value = message.rsplit("raise it: ", 1)[1].split("=")
    assert key == "limits.memory_gb"
    check_limits({"memory_gb": int(value)})  # what the CLI would accept, pasted
    with enforced(Limits(memory_gb=int(value))):
        check_memory(nbytes, "actions.r.with", "a thing")


def test_a_small_limit_is_printed_as_set_and_the_suggestion_is_a_whole_gb() -> None:
    with enforced(Limits(memory_gb=0.001)), pytest.raises(ConfigError) as caught:
        check_memory(0.002 * GB, "input.shape")
    assert str(caught.value) == (
        "input.shape: would need 0.002 GB, more than limits.memory_gb=0.001; if that is meant, raise it:"
        " limits.memory_gb=1"
    )


def test_a_count_refusal_suggests_exactly_the_count() -> None:
    with enforced(SAFE_DEFAULTS):
        assert count_refusal(10_000, "batches") is None
        assert count_refusal(10_001, "batches") == (
            "10,001 batches are more than limits.count=10000; if that is meant, raise it: limits.count=10001"
        )
    with enforced(Limits(count=10_001)):
        check_count(10_001, "input.batches", "batches")


# ---------------------------------------------------------------- measuring a build on the meta device


def test_without_a_memory_bound_nothing_is_built_twice() -> None:
    calls = []
    with enforced(Limits(count=5)):
        check_built(lambda: calls.append(1), "model", "m")
    assert calls == []


def test_every_copy_is_counted() -> None:
    with enforced(Limits(memory_gb=1)):
        check_built(lambda: nn.Linear(8192, 8192), "w", "torch.nn.Linear", copies=3)  # 0.75 GB
        with pytest.raises(ConfigError, match=r"^w: would need 1\.25 GB \(5 × torch\.nn\.Linear: 0\.25 GB of tensors"):
            check_built(lambda: nn.Linear(8192, 8192), "w", "torch.nn.Linear", copies=5)


def test_a_tied_weight_counts_once_and_a_bare_tensor_counts() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16384, 16384, bias=False)  # 1 GB
            self.b = nn.Linear(16384, 16384, bias=False)
            self.b.weight = self.a.weight

    with enforced(Limits(memory_gb=1.01)):
        check_built(Tied, "model", "tied")
        with pytest.raises(ConfigError, match=r"^model: would need 4 GB"):
            check_built(lambda: torch.empty(2**30), "model", "a tensor")


def test_a_build_that_cannot_run_on_meta_is_left_to_the_real_build() -> None:
    def reads_values() -> nn.Module:
        layer = nn.Linear(2, 2)
        float(layer.weight.sum())  # values: impossible on meta
        return layer

    with enforced(Limits(memory_gb=1e-9)):
        check_built(reads_values, "model", "m")  # not measured, not refused


def test_more_modules_than_the_count_stop_the_meta_build_early() -> None:
    built = []

    def deep() -> nn.Module:
        layers = nn.Sequential()
        for i in range(100_000):
            layers.add_module(str(i), nn.Identity())
            built.append(i)
        return layers

    with enforced(Limits(memory_gb=8, count=50)), pytest.raises(ConfigError) as caught:
        check_built(deep, "model", "deep")
    assert str(caught.value) == (
        "model: builds more than 50 modules, more than limits.count=50; if that is meant, raise it: limits.count=500"
    )
    assert len(built) <= 51


def test_the_meta_build_leaves_every_random_state_as_it_was() -> None:
    def draws() -> nn.Module:
        random.random(), np.random.rand(), torch.rand(1, device="cpu")
        return nn.Linear(4, 4)

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with enforced(SAFE_DEFAULTS):
        check_built(draws, "model", "m")
    after = random.random(), np.random.rand(), torch.rand(1)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    assert after == (random.random(), np.random.rand(), torch.rand(1))


ALLOWED_MODULES: list[tuple[str, dict[str, Any]]] = [
    ("Linear", {"in_features": 7, "out_features": 5}),
    ("Bilinear", {"in1_features": 3, "in2_features": 4, "out_features": 5}),
    ("Conv1d", {"in_channels": 3, "out_channels": 4, "kernel_size": 3}),
    ("Conv2d", {"in_channels": 3, "out_channels": 4, "kernel_size": 3}),
    ("ConvTranspose2d", {"in_channels": 3, "out_channels": 4, "kernel_size": 3}),
    ("Embedding", {"num_embeddings": 11, "embedding_dim": 6}),
    ("EmbeddingBag", {"num_embeddings": 11, "embedding_dim": 6}),
    ("LayerNorm", {"normalized_shape": 9}),
    ("BatchNorm2d", {"num_features": 9}),
    ("GroupNorm", {"num_groups": 2, "num_channels": 8}),
    ("RMSNorm", {"normalized_shape": 9}),
    ("LSTM", {"input_size": 5, "hidden_size": 6, "num_layers": 2}),
    ("GRU", {"input_size": 5, "hidden_size": 6}),
    ("MultiheadAttention", {"embed_dim": 8, "num_heads": 2}),
    ("TransformerEncoderLayer", {"d_model": 8, "nhead": 2, "dim_feedforward": 16}),
    ("Transformer", {"d_model": 8, "nhead": 2, "num_encoder_layers": 1, "num_decoder_layers": 1, "batch_first": True}),
    ("PReLU", {"num_parameters": 5}),
    ("Upsample", {"scale_factor": 2}),
    ("ZeroPad2d", {"padding": 3}),
]


@pytest.mark.parametrize(("name", "args"), ALLOWED_MODULES, ids=[n for n, _ in ALLOWED_MODULES])
def test_allowlisted_modules_measure_on_meta_as_built_for_real(name: str, args: dict[str, Any]) -> None:
    """The meta estimate of a torch.nn class is exactly the bytes of its real tensors."""
    real = getattr(nn, name)(**args)
    nbytes = sum(t.nelement() * t.element_size() for t in {id(t): t for t in real.state_dict().values()}.values())
    with enforced(Limits(memory_gb=nbytes / GB)):
        check_built(lambda: getattr(nn, name)(**args), "with", name)  # exactly at the bound: admitted
    if nbytes:
        with enforced(Limits(memory_gb=(nbytes - 1) / GB)), pytest.raises(ConfigError, match=r"^with: would need"):
            check_built(lambda: getattr(nn, name)(**args), "with", name)


# ---------------------------------------------------------------- torch functions a config binds arguments of


def test_a_partial_torch_function_is_measured_on_meta_before_each_call() -> None:
    import functools
    import inspect

    import torch.nn.functional as F  # noqa: N812

    from surgery.core.limits import sized_call

    assert sized_call(F.gelu, "fn") is F.gelu  # nothing bound: nothing the config sized
    grow = sized_call(functools.partial(F.pad, pad=(0, 2**28)), "actions.m.fn")
    assert inspect.signature(grow) == inspect.signature(functools.partial(F.pad, pad=(0, 2**28)))
    x = torch.ones(4, 4)
    assert sized_call(functools.partial(F.pad, pad=(0, 3)), "fn")(x).shape == (4, 7)  # unbounded: as it is
    with enforced(SAFE_DEFAULTS), pytest.raises(ConfigError) as caught:
        grow(torch.ones(8, 4))
    assert str(caught.value).startswith("actions.m.fn: would need 8 GB (the output of pad), more than")
    with enforced(SAFE_DEFAULTS):
        assert torch.equal(sized_call(functools.partial(F.pad, pad=(1, 1)), "fn")(x), F.pad(x, (1, 1)))


def test_a_partial_of_other_code_is_never_run_twice() -> None:
    import functools

    from surgery.core.limits import sized_call

    calls = []

    def records(t: torch.Tensor, times: int) -> torch.Tensor:
        calls.append(times)
        return t * times

    wrapped = functools.partial(records, times=2)
    assert sized_call(wrapped, "fn") is wrapped
    with enforced(SAFE_DEFAULTS):
        wrapped(torch.ones(1))
    assert calls == [2]


def test_a_replacement_is_measured_on_its_meta_twin_before_each_call_and_only_under_a_bound() -> None:
    from surgery.core.limits import check_forward

    grows = nn.Upsample(scale_factor=4)
    check_forward(grows, lambda: nn.Upsample(scale_factor=4), "actions.r.with")  # unbounded: no hook at all
    assert not grows._forward_pre_hooks
    with enforced(Limits(memory_gb=1e-6)):  # 1 KB
        check_forward(grows, lambda: nn.Upsample(scale_factor=4), "actions.r.with")
        assert grows(torch.ones(1, 1, 2, 2)).shape == (1, 1, 8, 8)  # 256 bytes
        with pytest.raises(ConfigError, match=r"^actions\.r\.with: would need .* \(the output of Upsample on this"):
            grows(torch.ones(1, 1, 8, 8))  # 4 KB
    assert grows(torch.ones(1, 1, 8, 8)).shape == (1, 1, 32, 32)  # the bound is the run's, not the module's
