"""Custom callables, replace_module, on_load, patching and structured inputs/outputs."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import surgery
from surgery.errors import ActionError, ConfigError
from surgery.models.cnn import CNN
from surgery.models.functions import Functions
from tests.conftest import Snapshot, TinyNet

# ---------------------------------------------------------------- custom callables and safe mode


def test_replace_forward_with_an_import_path_callable(functions: Functions, x12) -> None:
    action = {"f": {"kind": "replace_forward", "type": "Function_*", "fn": "tests.helpers_callables:double_plus_one"}}
    with surgery.apply(functions, action):
        out = functions(*x12)
    x1, x2 = x12
    ab = (2 * x1 + 1) + (2 * x2 + 1)
    assert torch.equal(out, 2 * (2 * ab + 1) + 1)


def test_op_fn_by_path_and_by_partial_target_node() -> None:
    model = nn.Sequential(nn.Identity())
    x = torch.tensor([[1.0, -2.0]])
    with surgery.apply(model, {"n": {"kind": "modify_output", "select": "0", "op": "fn",
                                      "fn": "tests.helpers_callables:negate"}}):  # fmt: skip
        assert torch.equal(model(x), -x)
    node = {"_target_": "tests.helpers_callables.scale", "_partial_": True, "factor": 3.0}
    with surgery.apply(model, {"s": {"kind": "modify_output", "select": "0", "op": "fn", "fn": node}}):
        assert torch.equal(model(x), 3 * x)
    torch_node = {"_target_": "torch.clamp", "_partial_": True, "min": 0.0}
    with surgery.apply(model, {"c": {"kind": "modify_output", "select": "0", "op": "fn", "fn": torch_node}}, safe=True):
        assert torch.equal(model(x), x.clamp(min=0))


@pytest.mark.parametrize(
    ("action", "fragment"),
    [
        ({"kind": "replace_forward", "type": "Linear", "fn": "tests.helpers_callables:double_plus_one"},
         "actions.a.fn: 'tests.helpers_callables:double_plus_one' is not on the safe-mode allowlist, refused because"),
        ({"kind": "modify_output", "select": "fc", "op": "fn", "fn": {"_target_": "os.system", "_partial_": True}},
         "actions.a.fn._target_: 'os.system' is not on the safe-mode allowlist, refused because safe=true"),
        ({"kind": "replace_module", "type": "ReLU", "with": {"_target_": "collections.OrderedDict"}},
         "actions.a.with._target_: 'collections.OrderedDict' is not on the safe-mode allowlist"),
    ],
)  # fmt: skip
def test_safe_mode_refuses_code_the_config_names(action: dict, fragment: str, tiny: TinyNet) -> None:
    with pytest.raises(ConfigError) as info:
        surgery.plan(tiny, {"a": action}, safe=True)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("fn", "fragment"),
    [
        ("tests.nope:f", "cannot import 'tests.nope'"),
        ("tests.helpers_callables:nope", "'tests.helpers_callables' has no 'nope'"),
        ("tests.helpers_callables:__doc__", "gives a str, which is not callable"),
        ({"_target_": "torch.no_such_thing"}, "cannot build 'torch.no_such_thing'"),
    ],
)
def test_bad_callables_are_config_errors_at_plan_time(fn, fragment: str, tiny: TinyNet) -> None:
    with pytest.raises(ConfigError, match="actions.a.fn") as info:
        surgery.plan(tiny, {"a": {"kind": "modify_output", "select": "fc", "op": "fn", "fn": fn}})
    assert fragment in str(info.value)


# ---------------------------------------------------------------- replace_module


def test_replace_module_relu_to_gelu_and_back(x_img) -> None:
    torch.manual_seed(0)
    model = CNN(channels=(4, 4, 4)).eval()
    before = Snapshot.of(model)
    relu_out = model(torch.randn(1, 1, 28, 28, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(1, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    gelu = CNN(channels=(4, 4, 4), activation="gelu").eval()
    gelu.load_state_dict(model.state_dict())
    action = {"swap": {"kind": "replace_module", "type": "ReLU", "with": {"_target_": "torch.nn.GELU"}}}
    with surgery.apply(model, action):
        assert isinstance(model.block2.act, nn.GELU)
        assert torch.equal(model(x), gelu(x))
    assert isinstance(model.block2.act, nn.ReLU)
    assert torch.equal(model(x), relu_out)
    before.assert_same(model)


def test_later_actions_see_the_replacement() -> None:
    model = nn.Sequential(nn.ReLU())
    actions = {
        "swap": {"kind": "replace_module", "select": "0", "with": {"_target_": "torch.nn.Tanh"}},
        "cap": {"kind": "capture", "type": "Tanh", "what": ["output"]},
    }
    plan = surgery.plan(model, actions)
    assert plan.to_dict()[1]["matched"] == ["0"]
    x = torch.tensor([[-1.0, 1.0]])
    with surgery.apply(model, plan) as s:
        model(x)
    assert torch.equal(s.captures["cap"]["0"].output, torch.tanh(x))


def test_replace_module_refuses_the_root_and_nested_selections(tiny: TinyNet) -> None:
    with pytest.raises(ConfigError, match="root module has no parent"):
        surgery.plan(
            tiny, {"a": {"kind": "replace_module", "select": "<root>", "with": {"_target_": "torch.nn.Identity"}}}
        )
    nested = nn.Sequential(nn.Sequential(nn.ReLU()))
    with pytest.raises(ConfigError, match="matches both '0' and '0.0'"):
        surgery.plan(
            nested, {"a": {"kind": "replace_module", "select": "0.**", "with": {"_target_": "torch.nn.Identity"}}}
        )


# ---------------------------------------------------------------- on_load


def test_on_load_renames_keys_and_forgives_added_parameters(functions: Functions, x12) -> None:
    old = {
        k.replace("ab.", "layer_ab.").replace("cd.", "layer_cd."): torch.full((1,), 1.0) for k in functions.state_dict()
    }
    actions = {
        "add_b": {"kind": "add_parameter", "type": "Function_*", "name": "b", "shape": [1]},
        "load": {"kind": "on_load", "rename": {"layer_ab.**": "ab.**", "layer_cd.**": "cd.**"}},
    }
    before = Snapshot.of(functions)
    with surgery.apply(functions, actions) as s:
        result = s.load_state_dict(old)  # strict: renamed keys fit, the added b's are not missing
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert all(p.item() == 1.0 for n, p in functions.named_parameters() if n.endswith(".W"))
        with pytest.raises(RuntimeError, match="Missing key"):
            functions.load_state_dict({"ab.a.W": torch.ones(1)})  # others are still reported missing
    before.assert_same(functions)  # the load is undone with the surgery


def test_saved_surgered_model_reloads_strictly_with_the_same_actions(tmp_path, x12) -> None:
    from safetensors.torch import load_file, save_file

    model = Functions()
    with surgery.apply(model, "function_linear"):
        expected = model(*x12)
        save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, str(tmp_path / "m.safetensors"))
    fresh = Functions(w_a=9.0)
    with surgery.apply(fresh, "function_linear") as s:
        s.load_state_dict(load_file(str(tmp_path / "m.safetensors")), strict=True)
        assert torch.equal(fresh(*x12), expected)


def test_on_load_with_nothing_to_do_is_an_error(tiny: TinyNet) -> None:
    with pytest.raises(ConfigError, match="actions.a.rename: nothing to do"):
        surgery.plan(tiny, {"a": {"kind": "on_load"}})
    with pytest.raises(ConfigError, match="same wildcards"):
        surgery.plan(tiny, {"a": {"kind": "on_load", "rename": {"a.*": "b"}}})


# ---------------------------------------------------------------- patching


def test_activation_patching_from_an_earlier_runs_captures(tmp_path) -> None:
    from surgery.core.records import flatten_captures
    from surgery.files.write import write_tensors

    torch.manual_seed(0)
    model = CNN().eval()
    a, b = (torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    with surgery.apply(model, {"cap": {"kind": "capture", "select": "block2"}}) as s:
        model(a)
    write_tensors(tmp_path / "captures.safetensors", flatten_captures(s.captures))

    # by hand: run B with block2's output replaced by A's
    handle = model.block2.register_forward_hook(lambda m, i, o: s.captures["cap"]["block2"].output)
    expected = model(b)
    handle.remove()
    patch = {"kind": "modify_output", "select": "block2", "op": "patch",
             "from": {"file": str(tmp_path / "captures.safetensors"), "key": "cap/block2/output"}}  # fmt: skip
    with surgery.apply(model, {"p": patch}):
        assert torch.equal(model(b), expected)
    assert torch.equal(model(a), model.classifier(model.block3(s.captures["cap"]["block2"].output)))

    with pytest.raises(ConfigError, match=r"actions\.p\.from\.key: 'cap/block3/output' is not in .*Did you mean"):
        surgery.plan(model, {"p": {**patch, "from": {**patch["from"], "key": "cap/block3/output"}}})
    with pytest.raises(
        ConfigError,
        match=r"actions\.p\.from: 'cap/block2/output' has shape \[2, 16, 7, 7\], but the output of 'block3' is \[2,",
    ):
        surgery.plan(model, {"p": {**patch, "select": "block3"}}, example_inputs=(b,))
    with pytest.raises(ActionError, match=r"has shape \[2, 16, 7, 7\], which does not broadcast onto \[1, 16, 7, 7\]"):
        with surgery.apply(model, {"p": patch}):
            model(b[:1])  # without example inputs the check happens on the first call
    half = {**patch, "index": "[:, :8]"}
    with torch.no_grad():
        inner = model.block1(b)
        with surgery.apply(model, {"p": half}):
            out = model.block2(inner)  # first 8 channels from A, the rest its own
        own = model.block2(inner)
    patched = s.captures["cap"]["block2"].output
    assert torch.equal(out[:, :8], patched[:, :8]) and torch.equal(out[:, 8:], own[:, 8:])


# ---------------------------------------------------------------- structured inputs and outputs


class KwBlock(nn.Module):
    """Takes a keyword input and returns a dict, like many third-party blocks."""

    def forward(self, hidden: torch.Tensor, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = hidden if scale is None else hidden * scale
        return OrderedDict(last=out, doubled=out * 2)


def test_modify_input_by_keyword_name_whether_passed_by_keyword_or_position() -> None:
    model = KwBlock()
    h, s = torch.ones(2), torch.full((2,), 3.0)
    action = {"m": {"kind": "modify_input", "select": "<root>", "item": "scale", "op": "add", "value": 1}}
    with surgery.apply(model, action):
        assert torch.equal(model(h, scale=s)["last"], torch.full((2,), 4.0))
        assert torch.equal(model(h, s)["last"], torch.full((2,), 4.0))
        with pytest.raises(ActionError, match="input 'scale' was not passed"):
            model(h)


def test_capture_records_keyword_inputs_and_dict_outputs_by_key(tmp_path) -> None:
    from surgery.core.records import flatten_captures

    model = KwBlock()
    h, s = torch.ones(2), torch.full((2,), 3.0)
    with surgery.apply(model, {"c": {"kind": "capture", "select": "<root>", "what": ["input", "output"]}}) as cap:
        model(h, scale=s)
    rec = cap.captures["c"]["<root>"]
    assert torch.equal(rec.kwargs["scale"], s) and torch.equal(rec.output["doubled"], torch.full((2,), 6.0))
    assert set(flatten_captures(cap.captures)) == {
        "c/<root>/input.0", "c/<root>/input.scale", "c/<root>/output.last", "c/<root>/output.doubled"
    }  # fmt: skip


def test_modify_output_item_by_key_keeps_the_container_type() -> None:
    model = KwBlock()
    with surgery.apply(model, {"m": {"kind": "modify_output", "select": "<root>", "item": "doubled", "op": "zero"}}):
        out = model(torch.ones(2))
    assert isinstance(out, OrderedDict) and list(out) == ["last", "doubled"]
    assert torch.equal(out["last"], torch.ones(2)) and torch.equal(out["doubled"], torch.zeros(2))


def test_item_by_key_on_a_hugging_face_model_output() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class Head(nn.Module):
        def forward(self, x: torch.Tensor):
            return outputs.CausalLMOutput(logits=x * 2, loss=x.sum())

    model = Head()
    with surgery.apply(model, {"m": {"kind": "modify_output", "select": "<root>", "item": "logits", "op": "add",
                                      "value": 1}}):  # fmt: skip
        out = model(torch.ones(2))
    assert type(out).__name__ == "CausalLMOutput"
    assert torch.equal(out.logits, torch.full((2,), 3.0)) and torch.equal(out["logits"], out.logits)
    assert out.loss.item() == 2.0
