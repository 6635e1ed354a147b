"""Sources pinned down exactly (surgery/actions/sources.py): every refusal's whole message, the reduce/dim/item of a
capture source, which frozen call each main-pass call reads, and dtype/device moves; each against plain PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError
from tests.test_sources import Block, Stream


class Alternate(nn.Module):
    """Two blocks called in turn, twice each: a b a b."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList(Block(6) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for block in self.blocks:
                x = block(x)
        return x


class Thrice(nn.Module):
    """One block called three times per forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.block = Block(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(self.block(x)))


class Pair(nn.Module):
    """Returns (x + 1, 2 * x): a tuple output whose items differ."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, 2 * x


class Gate(nn.Module):
    """forward(x, mask=None) -> (x, 2 * x): input item 1 is None when no mask is given."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return x, 2 * x


class Cast(nn.Module):
    """Takes float64, returns float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 3).float()


class Holder(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> object:
        return self.inner(x, None) if isinstance(self.inner, Gate) else self.inner(x)


def model() -> Stream:
    torch.manual_seed(0)
    return Stream().eval()


def refused(actions: dict, message: str, **kw: object) -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(model(), actions, **kw)
    assert str(info.value) == message


def test_a_missing_key_names_the_file_and_lists_the_first_ten_keys(tmp_path: Path) -> None:
    many, ten = tmp_path / "many.safetensors", tmp_path / "ten.safetensors"
    save_file({f"k{i:02d}": torch.zeros(1) for i in range(11)}, str(many))
    save_file({f"k{i:02d}": torch.zeros(1) for i in range(10)}, str(ten))
    act = {"kind": "modify_output", "select": "blocks.0", "op": "patch"}
    listed = ", ".join(f"k{i:02d}" for i in range(10))
    refused({"a": {**act, "from": {"file": str(many), "key": "zzz"}}},
            f"actions.a.from.key: 'zzz' is not in {str(many)!r}. Keys: {listed} …")  # fmt: skip
    refused({"a": {**act, "from": {"file": str(ten), "key": "zzz"}}},
            f"actions.a.from.key: 'zzz' is not in {str(ten)!r}. Keys: {listed}")  # fmt: skip
    gone = str(tmp_path / "gone.safetensors")
    refused({"a": {**act, "from": {"file": gone, "key": "k"}}},
            f"actions.a.from.file: {gone!r} does not exist; capture it first (e.g. kind: capture)",
            example_inputs=(torch.randn(2, 5, 6),))  # fmt: skip


def test_a_file_source_patches_like_the_same_tensor_written_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    save_file({"blocks.0": torch.randn(5, 6)}, str(path))
    m, x = model(), torch.randn(2, 5, 6)
    act = {"kind": "modify_output", "select": "blocks.0", "op": "set", "from": {"file": str(path), "key": "blocks.0"}}
    with surgery.apply(m, {"a": act}, example_inputs=(x,)):
        got = m(x)
    from safetensors.torch import load_file

    src = load_file(str(path))["blocks.0"]
    expected = m.out(m.blocks[2](m.blocks[1](src.expand(2, 5, 6).clone())))
    assert torch.equal(got, expected)


def test_a_python_tensor_under_safe_gets_the_whole_message() -> None:
    refused({"a": {"kind": "modify_output", "select": "blocks.0", "op": "add", "value": torch.ones(6)}},
            "actions.a.value: a Python tensor is refused because safe=true (safe recipes are config text;"
            " give it as from: {file, key} instead, or set safe=false)", safe=True)  # fmt: skip


def test_a_full_shape_source_with_index_passes_the_probe_forward() -> None:
    m, x = model(), torch.randn(2, 5, 6)
    full = torch.randn(2, 5, 6)
    actions = {"p": {"kind": "modify_output", "select": "blocks.1", "op": "patch", "from": full, "index": "[:, 1:3]"}}
    with surgery.apply(m, actions, example_inputs=(x,)):
        got = m(x)
    h = m.blocks[1](m.blocks[0](x)).clone()
    h[:, 1:3] = full[:, 1:3]
    assert torch.equal(got, m.out(m.blocks[2](h)))


@pytest.mark.parametrize("key", ["value", "from"])
def test_a_source_that_stops_fitting_at_call_time_names_its_key(key: str) -> None:
    m = model()
    with surgery.apply(m, {"a": {"kind": "modify_output", "select": "blocks.0", "op": "add", key: torch.ones(4)}}):
        with pytest.raises(ActionError) as info:
            m(torch.randn(2, 5, 6))
    assert str(info.value) == (
        f"actions.a.{key} on module 'blocks.0': the source has shape [4], which does not broadcast onto [2, 5, 6]"
    )


def test_a_tensor_source_moves_to_the_models_device() -> None:
    m = model().to("meta")
    with surgery.apply(m, {"a": {"kind": "modify_output", "select": "blocks.0", "op": "add", "value": torch.ones(6)}}):
        got = m(torch.empty(2, 5, 6, device="meta"))
    assert got.device.type == "meta" and got.shape == (2, 5, 2)


def test_a_capture_source_of_another_dtype_is_cast_to_the_tensors_dtype() -> None:
    m, x = Holder(Cast()), torch.randn(2, 3, dtype=torch.float64)
    actions = {
        "c": {"kind": "capture", "select": "inner", "what": ["input"]},
        "a": {"kind": "modify_output", "select": "inner", "op": "add", "from": {"capture": "c", "what": "input"}},
    }
    with surgery.apply(m, actions):
        got = m(x)
    expected = (x * 3).float() + x.float()
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def test_modify_grad_refuses_a_capture_source() -> None:
    refused({"c": {"kind": "capture", "select": "blocks.0"},
             "g": {"kind": "modify_grad", "select": "blocks.0", "op": "add", "from": {"capture": "c"}}},
            "actions.g.from.capture: a capture source is read by modify_output and modify_input only")  # fmt: skip


def test_an_unknown_capture_lists_the_captures_before_it() -> None:
    src = {"kind": "modify_output", "select": "blocks.0", "op": "set", "from": {"capture": "c2"}}
    cap, log = {"kind": "capture", "select": "blocks.0"}, {"kind": "log", "select": "blocks.0"}
    refused({"c1": cap, "lg": log, "c3": cap, "a": src},
            "actions.a.from.capture: no capture action 'c2' is listed before this one. Did you mean 'c3' or 'c1'?"
            " Captures listed before: c1, c3 (a source must come first)")  # fmt: skip
    refused({"lg": log, "a": src},
            "actions.a.from.capture: no capture action 'c2' is listed before this one."
            " Captures listed before: none (a source must come first)")  # fmt: skip


def test_capture_sources_that_cannot_serve_are_refused_with_the_whole_message() -> None:
    src = {"kind": "modify_output", "select": "blocks.0", "op": "set", "from": {"capture": "c"}}
    cap = {"kind": "capture", "select": "blocks.0"}
    refused(
        {"c": {**cap, "enabled": False}, "a": src},
        "actions.a.from.capture: capture 'c' is disabled (enabled: false), so it records nothing",
    )
    stats = ("actions.a.from.capture: capture 'c' keeps statistics or function calls, not module calls; a source"
             " needs reduce: none and no function")  # fmt: skip
    refused({"c": {**cap, "reduce": "mean"}, "a": src}, stats)
    refused({"c": {**cap, "function": "tanh"}, "a": src}, stats)
    refused(
        {"c": cap, "a": {**src, "from": {"capture": "c", "what": "input"}}},
        "actions.a.from.what: capture 'c' records output, not input",
    )
    refused({"c": cap, "a": {**src, "select": "blocks.*"}},
            "actions.a.from.capture: capture 'c' does not record 'blocks.1' (a source is read on the same"
            " module); select it in both")  # fmt: skip


@pytest.mark.parametrize("dim", [None, 1, [0, 1]])
def test_a_mean_source_averages_over_dim_keeping_it(dim: object) -> None:
    m, x = model(), torch.randn(4, 5, 6)
    source: dict = {"capture": "c", "reduce": "mean"} | ({} if dim is None else {"dim": dim})
    actions = {"c": {"kind": "capture", "select": "blocks.1"},
               "a": {"kind": "modify_output", "select": "blocks.1", "op": "add", "from": source}}  # fmt: skip
    with surgery.apply(m, actions):
        got = m(x)
    dims = (0,) if dim is None else tuple(dim) if isinstance(dim, list) else (dim,)
    h = m.blocks[1](m.blocks[0](x))
    assert torch.equal(got, m.out(m.blocks[2](h + h.mean(dim=dims, keepdim=True))))


def test_a_capture_source_reads_the_same_item_of_a_tuple_output() -> None:
    m, x = Holder(Pair()), torch.randn(2, 3)
    actions = {"c": {"kind": "capture", "select": "inner"},
               "a": {"kind": "modify_output", "select": "inner", "op": "add", "item": 1,
                     "from": {"capture": "c"}}}  # fmt: skip
    with surgery.apply(m, actions):
        first, second = m(x)
    assert torch.equal(first, x + 1) and torch.equal(second, 2 * x + 2 * x)


def test_a_capture_source_item_that_is_not_a_tensor_is_named() -> None:
    m = Holder(Gate())
    actions = {"c": {"kind": "capture", "select": "inner", "what": ["input"]},
               "a": {"kind": "modify_output", "select": "inner", "op": "add", "item": 1,
                     "from": {"capture": "c", "what": "input"}}}  # fmt: skip
    with surgery.apply(m, actions), pytest.raises(ActionError) as info:
        m(torch.randn(2, 3))
    assert str(info.value) == "actions.a.from on module 'inner': capture 'c' recorded a NoneType here, not a tensor"


class Scaled(nn.Module):
    """forward(x, k) -> x * k, called with an int k."""

    def forward(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return x * k


def test_a_capture_source_item_names_the_type_it_recorded() -> None:
    m = nn.Sequential()
    m.inner = Scaled()
    actions = {"c": {"kind": "capture", "select": "inner", "what": ["input"]},
               "a": {"kind": "modify_output", "select": "inner", "op": "add", "item": 1,
                     "from": {"capture": "c", "what": "input"}}}  # fmt: skip
    with surgery.apply(m, actions), pytest.raises(ActionError) as info:
        m.inner(torch.randn(2, 3), 2)
    assert str(info.value) == "actions.a.from on module 'inner': capture 'c' recorded a int here, not a tensor"


def test_reading_before_any_call_or_after_an_empty_source_pass_says_so() -> None:
    m, x = model(), torch.randn(2, 5, 6)
    actions = {"c": {"kind": "capture", "select": "out", "what": ["input"]},
               "a": {"kind": "modify_input", "select": "out", "op": "add",
                     "from": {"capture": "c", "what": "input"}}}  # fmt: skip
    with surgery.apply(m, actions) as s:
        with pytest.raises(ActionError) as info:
            m(x)
        assert str(info.value) == (
            "actions.a.from on module 'out': capture 'c' has recorded no call of 'out' yet (modify_input runs"
            " before a capture records the call: run a source pass, Surgery.freeze_sources())"
        )
        with s.source_pass():
            pass
        with pytest.raises(ActionError) as info:
            m(x)
        assert (
            str(info.value)
            == "actions.a.from on module 'out': capture 'c' recorded no call of 'out' in the source pass"
        )


def outputs(m: nn.Module, modules: list[nn.Module], x: torch.Tensor) -> list[list[torch.Tensor]]:
    """Each module's outputs, call by call, in a plain forward."""
    seen: list[list[torch.Tensor]] = [[] for _ in modules]
    handles = [mod.register_forward_hook(lambda mod, a, o, i=i: seen[i].append(o)) for i, mod in enumerate(modules)]
    m(x)
    for h in handles:
        h.remove()
    return seen


def adding(
    m: nn.Module, modules: list[nn.Module], x: torch.Tensor, srcs: list[list[torch.Tensor]], new: list | None = None
) -> torch.Tensor:
    """The forward with call k of each module getting srcs[module][k] added, written by hand (``new`` gets the
    outputs before the change: what a capture listed first records)."""
    count = [0 for _ in modules]

    def hook(i: int) -> object:
        def add(mod: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
            k, count[i] = count[i], count[i] + 1
            out = o + srcs[i][k]
            if new is not None:
                new[i].append(o.detach())
            return out

        return add

    handles = [mod.register_forward_hook(hook(i)) for i, mod in enumerate(modules)]
    try:
        return m(x)
    finally:
        for h in handles:
            h.remove()


def test_call_k_of_each_module_reads_its_own_call_k_when_modules_alternate() -> None:
    m, a, b = Alternate(), torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    mods = list(m.blocks)
    actions = {"c": {"kind": "capture", "select": "blocks.*"},
               "p": {"kind": "modify_output", "select": "blocks.*", "op": "add", "from": {"capture": "c"}}}  # fmt: skip
    with surgery.apply(m, actions) as s:
        with s.source_pass():
            m(a)
        got = m(b)
    assert torch.equal(got, adding(m, mods, b, outputs(m, mods, a)))


def test_three_calls_read_calls_0_1_2_and_a_new_freeze_counts_from_0() -> None:
    m, a, b = Thrice(), torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    actions = {"c": {"kind": "capture", "select": "block"},
               "p": {"kind": "modify_output", "select": "block", "op": "add", "from": {"capture": "c"}}}  # fmt: skip
    with surgery.apply(m, actions) as s:
        with s.source_pass():
            m(a)
        first = m(b)
        s.freeze_sources()  # what the capture recorded since (the main pass's calls) is now the source
        second = m(b)
    src = outputs(m, [m.block], a)
    main: list[list[torch.Tensor]] = [[]]
    assert torch.equal(first, adding(m, [m.block], b, src, main))
    assert torch.equal(second, adding(m, [m.block], b, main))


def test_a_keep_last_capture_serves_its_one_call_to_every_call() -> None:
    m, a, b = Thrice(), torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    actions = {"c": {"kind": "capture", "select": "block", "keep": "last"},
               "p": {"kind": "modify_output", "select": "block", "op": "add", "from": {"capture": "c"}}}  # fmt: skip
    with surgery.apply(m, actions) as s:
        with s.source_pass():
            m(a)
        got = m(b)
    last = outputs(m, [m.block], a)[0][-1]
    assert torch.equal(got, adding(m, [m.block], b, [[last] * 3]))
