"""The bad-input corpus: one row per mistake a user can make, and what they must be told.

A row is either an action (``action``: the dict of one action named ``a``, run on ``+model=cnn``)
or a list of CLI overrides (``overrides``), plus the fragments the one-line message must
contain and the key it must start with (``where``). ``files`` names a writer in
``files.WRITERS`` that puts the files the row reads into the working directory first; paths in
rows are relative to it, so messages are the same in every run (and in docs/errors.md).

``at`` says when the mistake is caught: ``plan`` (before the model is touched; the default) or
``forward`` (a hook fails while the model runs; the surgery is still removed cleanly).
``hydra`` rows are Hydra composition errors: they have no in-process form (compose raises
Hydra's own exception), only the CLI's exit 2. ``xfail`` marks a finding: the row says what
*should* happen and the reason says what happens now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from surgery.errors import ActionError, ConfigError, NoMatchError, SurgeryError

CNN = ("+model=cnn",)


@dataclass(frozen=True)
class Case:
    """One bad input and what the user must be told."""

    id: str
    where: str  # the message starts with this key: actions.a.KEY, a run setting, model.checkpoint, input.path
    fragments: tuple[str, ...]
    action: dict[str, Any] | None = None  # one action named `a`, on the cnn model
    overrides: tuple[str, ...] = CNN  # CLI overrides; with `action`, the action is added to them
    files: str | None = None  # a writer in files.WRITERS, run in the working directory first
    error: type = ConfigError
    at: str = "plan"  # plan | forward
    hydra: bool = False  # a Hydra composition error: CLI only
    xfail: str | None = None  # a finding: what happens now

    @property
    def python(self) -> bool:
        """Whether the row also runs through ``surgery.plan/apply`` on a model (action rows)."""
        return self.action is not None


def act(case_id: str, where: str, fragments: tuple[str, ...] | str, action: dict[str, Any], **kw: Any) -> Case:
    """An action row: ``where`` is relative to ``actions.a``."""
    fragments = (fragments,) if isinstance(fragments, str) else fragments
    return Case(case_id, f"actions.a.{where}" if where else "actions.a", fragments, action=action, **kw)


def run(case_id: str, where: str, fragments: tuple[str, ...] | str, *overrides: str, **kw: Any) -> Case:
    """An overrides row (run settings, model, inputs, shipped recipes)."""
    fragments = (fragments,) if isinstance(fragments, str) else fragments
    return Case(case_id, where, fragments, overrides=overrides, **kw)


CASES: list[Case] = [
    # ------------------------------------------------------------ unknown kind
    act("kind_typo", "kind", ("unknown action kind 'inti'", "Did you mean 'init'?", "Available:"),
        {"kind": "inti", "select": "classifier.1", "param": "weight", "method": "ones"}),
    act("kind_case", "kind", ("unknown action kind 'Capture'", "Did you mean 'capture'"),
        {"kind": "Capture", "select": "block1"}),
    act("kind_missing", "kind", ("every action needs a kind", "capture"), {"select": "block1"}),
    act("kind_not_a_mapping", "", ("a mapping", "'capture'"), "capture"),
    # ------------------------------------------------------------ misspelt key (did you mean)
    act("key_parm", "parm", ("unknown key", "Did you mean 'param'?"),
        {"kind": "init", "select": "classifier.1", "parm": "weight", "method": "ones"}),
    act("key_selct", "selct", ("unknown key", "Did you mean 'select'?"), {"kind": "capture", "selct": "block1"}),
    act("key_vaule", "vaule", ("unknown key", "Did you mean 'value'"),
        {"kind": "modify_output", "select": "block1", "op": "add", "vaule": 1}),
    act("key_init_methd", "init.methd", ("unknown key", "Did you mean 'method'"),
        {"kind": "add_parameter", "select": "block1.conv", "name": "g", "shape": [2], "init": {"methd": "ones"}}),
    act("key_exp", "exp", ("unknown key", "Did you mean 'expr'?"),
        {"kind": "replace_forward", "type": "ReLU", "exp": "x"}),
    act("key_renames", "renames", ("unknown key", "Did you mean 'rename'"),
        {"kind": "on_load", "renames": {"a.*": "b.*"}}),
    act("key_excludes", "excludes", ("unknown key", "Did you mean 'exclude'?"),
        {"kind": "log", "select": "block1.*", "excludes": "block1.act"}),
    act("key_other_kinds", "method", ("unknown key", "Keys here:"),
        {"kind": "freeze", "select": "block1.conv", "method": "ones"}),
    run("run_setting_typo", "verbos", ("unknown key", "Did you mean 'verbose'?"), *CNN, "+verbos=true"),
    # ------------------------------------------------------------ wrong type
    act("type_value_str", "value", ("'big'", "could not be converted to Float"),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "constant", "value": "big"}),
    act("type_shape_str", "shape", ("'four'",),
        {"kind": "add_parameter", "select": "block1.conv", "name": "g", "shape": ["four"]}),
    act("type_select_int", "select", ("glob string", "3"), {"kind": "capture", "select": 3}),
    act("type_allow_empty", "allow_empty", ("'perhaps'",),
        {"kind": "capture", "select": "block1", "allow_empty": "perhaps"}),
    act("type_requires_grad", "requires_grad", ("'sometimes'",),
        {"kind": "add_parameter", "select": "block1.conv", "name": "g", "shape": [2], "requires_grad": "sometimes"}),
    act("type_item_list", "item", ("int position or a str key", "[1, 2]"),
        {"kind": "modify_output", "select": "block1", "op": "zero", "item": [1, 2]}),
    act("type_grad_item_str", "item", ("'first'",),
        {"kind": "modify_grad", "select": "block1", "op": "zero", "item": "first"}),
    act("type_what_str", "what", ("output",), {"kind": "capture", "select": "block1", "what": "output"}),
    act("type_rename_list", "rename", ("mapping",), {"kind": "on_load", "rename": ["a", "b"]}),
    act("type_dim_str", "dim", ("'batch'",),
        {"kind": "modify_output", "select": "block1", "op": "mean_ablate", "dim": "batch"}),
    act("type_enabled", "enabled", ("'later'",), {"kind": "capture", "select": "block1", "enabled": "later"}),
    act("type_stats", "stats", ("'lots'",), {"kind": "log", "select": "block1", "stats": "lots"}),
    act("type_shape_scalar", "shape", ("list", "[4]"),
        {"kind": "add_parameter", "select": "block1.conv", "name": "g", "shape": 4}),
    act("type_select_empty_list", "select", ("non-empty list",), {"kind": "capture", "select": []}),
    act("type_select_empty_str", "select", ("non-empty glob string",), {"kind": "capture", "select": ""}),
    act("type_list_with_int", "type", ("glob string", "3"), {"kind": "capture", "type": ["Conv2d", 3]}),
    act("type_fn_not_callable", "fn", ("'torch:pi' gives a float, which is not callable",),
        {"kind": "modify_output", "select": "block1", "op": "fn", "fn": "torch:pi"}),
    act("type_fn_mapping", "fn", ("expected pkg.module:function or a _target_ node",),
        {"kind": "modify_output", "select": "block1", "op": "fn", "fn": {"a": 1}}),
    act("type_index_int", "index", ("must be written in brackets",),
        {"kind": "modify_output", "select": "block1", "op": "zero", "index": 5}),
    # ------------------------------------------------------------ missing required value
    act("missing_param", "param", "a value is required", {"kind": "init", "select": "classifier.1", "method": "ones"}),
    act("missing_method", "method", "a value is required",
        {"kind": "init", "select": "classifier.1", "param": "weight"}),
    act("missing_name", "name", "a value is required", {"kind": "add_parameter", "select": "block1", "shape": [2]}),
    act("missing_op", "op", "a value is required", {"kind": "modify_output", "select": "block1"}),
    act("missing_with", "with", "a value is required", {"kind": "replace_module", "type": "ReLU"}),
    act("missing_value_add", "value", "op 'add' needs value",
        {"kind": "modify_output", "select": "block1", "op": "add"}),
    act("noise_negative_std", "std", ("must be >= 0", "-0.5"),
        {"kind": "modify_output", "select": "block1", "op": "noise", "std": -0.5}),
    act("missing_std_noise", "std", "op 'noise' needs std",
        {"kind": "modify_input", "select": "block1", "op": "noise"}),
    act("missing_max_norm", "max_norm", "op 'clip_norm' needs max_norm",
        {"kind": "modify_grad", "select": "block1", "op": "clip_norm"}),
    act("missing_expr", "expr", "op 'expr' needs expr", {"kind": "modify_output", "select": "block1", "op": "expr"}),
    act("missing_fn", "fn", "op 'fn' needs fn", {"kind": "modify_output", "select": "block1", "op": "fn"}),
    act("missing_from", "from", "op 'patch' needs from", {"kind": "modify_output", "select": "block1", "op": "patch"}),
    act("missing_constant_value", "value", "method 'constant' needs a value",
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "constant"}),
    act("missing_shape_or_like", "shape", "give exactly one of shape",
        {"kind": "add_buffer", "select": "block1.conv", "name": "m"}),
    act("missing_fn_or_expr", "fn", "give exactly one of fn", {"kind": "replace_forward", "type": "ReLU"}),
    act("both_shape_and_like", "shape", "give exactly one of shape",
        {"kind": "add_buffer", "select": "block1.conv", "name": "m", "shape": [8], "like": "bias"}),
    act("capture_what_empty", "what", "list at least one of input, output",
        {"kind": "capture", "select": "block1", "what": []}),
    act("capture_what_typo", "what", ("'outputs' is not one of input, output", "Did you mean 'output'"),
        {"kind": "capture", "select": "block1", "what": ["outputs"]}),
    act("capture_to_unknown", "to", ("'s3' is not one of memory",),
        {"kind": "capture", "select": "block1", "to": "s3"}),
    act("capture_reduce_unknown", "reduce", ("'median' is not one of none, mean, stats",),
        {"kind": "capture", "select": "block1", "reduce": "median"}),
    act("capture_max_bytes_zero", "max_bytes", ("must be a positive number of bytes",),
        {"kind": "capture", "select": "block1", "max_bytes": 0}),
    act("grad_param_with_item", "item", ("drop item when param is set",),
        {"kind": "modify_grad", "select": "classifier.1", "param": "weight", "item": 0, "op": "zero"}),
    run("missing_patch_file", "actions.patch_block3.from.file", ("a value is required",),
        *CNN, "+actions=patch_block3"),
    run("missing_input_path", "input.path", "a file is required", *CNN, "+actions=linearize", "+input=file"),
    # ------------------------------------------------------------ selector matching nothing
    act("select_nothing", "select", ("'block4' matched no module", "Closest module names: block3, block2, block1",
                                     "allow_empty"), {"kind": "capture", "select": "block4"}, error=NoMatchError),
    act("select_glob_nothing", "select", ("'block*.convv' matched no module", "block1.conv"),
        {"kind": "capture", "select": "block*.convv"}, error=NoMatchError),
    act("type_nothing", "type", ("'Conv3d' matched no module", "Did you mean 'Conv2d'?", "Types in this model:"),
        {"kind": "capture", "type": "Conv3d"}, error=NoMatchError),
    act("select_and_type_disjoint", "type", ("'Linear' matched none of the 3 module(s) selected", "Conv2d"),
        {"kind": "capture", "select": "block*.conv", "type": "Linear"}, error=NoMatchError),
    act("exclude_everything", "exclude", ("'block1.*'", "removed every module"),
        {"kind": "capture", "select": "block1.conv", "exclude": "block1.*"}, error=NoMatchError),
    act("bad_glob", "select", ("`**` must be a whole segment",), {"kind": "capture", "select": "block**conv"}),
    act("bad_glob_bracket", "select", ("unclosed '['",), {"kind": "capture", "select": "block[12"}),
    act("param_dotted", "param", ("has no '.'", "select"),
        {"kind": "init", "select": "block1", "param": "conv.weight", "method": "ones"}),
    # ------------------------------------------------------------ parameter not on the module
    act("param_typo", "param", ("'wieght' matched no parameter", "Closest parameter names: weight"),
        {"kind": "init", "select": "classifier.1", "param": "wieght", "method": "ones"}, error=NoMatchError),
    act("param_on_activation", "param", ("matched no parameter of the 3 selected module(s)",),
        {"kind": "freeze", "type": "ReLU", "param": "weight"}, error=NoMatchError),
    act("param_grad_missing", "param", ("'scale' matched no parameter",),
        {"kind": "modify_grad", "select": "classifier.1", "param": "scale", "op": "zero"}, error=NoMatchError),
    act("like_missing", "like", ("no parameter or buffer 'gamma'", "weight, bias"),
        {"kind": "add_parameter", "select": "classifier.1", "name": "g", "like": "gamma"}),
    act("linear_without_weight", "fn", ("'linear' needs a weight", "ReLU"),
        {"kind": "replace_forward", "type": "ReLU", "fn": "linear"}),
    act("expr_module_attr_missing", "expr", ("'W'", "weight"),
        {"kind": "replace_forward", "select": "classifier.1", "expr": "x @ module.W.T"}),
    run("grad_hook_on_frozen", "actions.a.param", ("block1.conv.weight", "requires_grad"), *CNN,
        "+actions.f={kind:freeze,select:block1.conv}",
        "+actions.a={kind:capture_grad,select:block1.conv,param:weight}"),
    act("name_taken", "name", ("already has an attribute 'bias'",),
        {"kind": "add_parameter", "select": "classifier.1", "name": "bias", "shape": [10]}),
    act("name_not_identifier", "name", ("not a public Python identifier",),
        {"kind": "add_buffer", "select": "classifier.1", "name": "my-mask", "shape": [10]}),
    act("item_not_an_input", "item", ("has no input 'hidden'", "its inputs: input"),
        {"kind": "modify_input", "select": "classifier.1", "op": "zero", "item": "hidden"}),
    # ------------------------------------------------------------ shape that does not fit
    act("shape_too_large", "shape", ("[1000000, 1000000, 1000000]", "elements of float32", "more than all the memory"),
        {"kind": "add_parameter", "select": "block1.conv", "name": "g", "shape": [10**6, 10**6, 10**6]}),
    act("shape_negative", "shape", ("sizes must be >= 0",),
        {"kind": "add_parameter", "select": "block1.conv", "name": "g", "shape": [-1]}),
    act("index_too_many_dims", "index", ("too many indices",),
        {"kind": "modify_output", "select": "classifier.1", "op": "zero", "index": "[0, 0, 0, 0]"}),
    act("expr_runtime_error_multiline", "expr", ("'clamp(1, 0, 2)' failed", "invalid combination of arguments"),
        {"kind": "replace_forward", "type": "ReLU", "expr": "clamp(1, 0, 2)"}, error=ActionError, at="forward"),
    act("expr_wrong_shape", "expr", ("'x.reshape(7, 5)' failed", "shape"),
        {"kind": "replace_forward", "select": "block1.pool", "expr": "x.reshape(7, 5)"}, error=ActionError,
        at="forward"),
    # ------------------------------------------------------------ init method that does not fit the tensor
    act("init_xavier_on_bias", "method", ("'xavier_uniform' needs a tensor of 2 or more dims", "classifier.1.bias"),
        {"kind": "init", "select": "classifier.1", "param": "*", "method": "xavier_uniform"}),
    act("init_eye_on_conv", "method", ("'eye' needs a 2-D tensor", "[8, 1, 3, 3]"),
        {"kind": "init", "select": "block1.conv", "param": "weight", "method": "eye"}),
    act("init_dirac_on_linear", "method", ("'dirac' needs a 3-, 4- or 5-D tensor",),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "dirac"}),
    act("init_orthogonal_new_vector", "init.method", ("'orthogonal' needs a tensor of 2 or more dims",),
        {"kind": "add_parameter", "select": "block1.conv", "name": "g", "shape": [3],
         "init": {"method": "orthogonal"}}),
    act("init_unknown_method", "method", ("'xavier' is not one of", "Did you mean"),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "xavier"}),
    act("init_bad_mode", "mode", ("'fan_avg' is not one of fan_in, fan_out",),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "kaiming_normal", "mode": "fan_avg"}),
    act("init_bad_nonlinearity", "nonlinearity", ("'relux'", "relu"),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "kaiming_normal",
         "nonlinearity": "relux"}),
    act("init_negative_std", "std", ("-1",),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "normal", "std": -1.0}),
    act("init_uniform_reversed", "a", ("a <= b", "2.0", "1.0"),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "uniform", "a": 2.0, "b": 1.0}),
    act("init_unused_value", "value", ("method 'ones' does not use value", "taken by constant"),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "ones", "value": 3}),
    act("init_unused_mean", "init.mean", ("method 'zeros' does not use mean", "taken by normal, trunc_normal"),
        {"kind": "add_parameter", "select": "block1.conv", "name": "g", "shape": [2],
         "init": {"method": "zeros", "mean": 1.0}}),
    act("init_unused_gain", "gain", ("method 'kaiming_normal' does not use gain", "xavier_uniform"),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "kaiming_normal", "gain": 2.0}),
    act("init_negative_gain", "gain", ("-1.0",),
        {"kind": "init", "select": "classifier.1", "param": "weight", "method": "xavier_uniform", "gain": -1.0}),
    # ------------------------------------------------------------ bad or escaping expressions
    act("expr_import", "expr", ("__import__",),
        {"kind": "replace_forward", "type": "ReLU", "expr": "__import__('os').system('true')"}),
    act("expr_dunder", "expr", ("names starting with '_' are not allowed",),
        {"kind": "replace_forward", "type": "ReLU", "expr": "x.__class__"}),
    act("expr_lambda", "expr", ("lambdas are not allowed",),
        {"kind": "modify_output", "select": "block1", "op": "expr", "expr": "lambda: output"}),
    act("expr_unknown_function", "expr", ("unknown function 'relux'", "Did you mean 'relu'"),
        {"kind": "replace_forward", "type": "ReLU", "expr": "relux(x)"}),
    act("expr_syntax", "expr", ("is not a valid expression",),
        {"kind": "replace_forward", "type": "ReLU", "expr": "x +"}),
    act("expr_open", "expr", ("unknown function 'open'",),
        {"kind": "replace_forward", "type": "ReLU", "expr": "open('/etc/passwd')"}),
    act("expr_inplace_method", "expr", ("unknown tensor method '.add_()'", "In-place methods are never allowed"),
        {"kind": "modify_output", "select": "block1", "op": "expr", "expr": "output.add_(1)"}),
    act("expr_huge_power", "expr", ("cannot compute",),
        {"kind": "modify_output", "select": "block1", "op": "expr", "expr": "output * 9 ** 9 ** 9"}),
    act("expr_wrong_variable", "expr", ("variable 'output' is not available here", "allowed: x, module"),
        {"kind": "modify_input", "select": "block1", "op": "expr", "expr": "output * 2"}),
    act("expr_grad_variable", "expr", ("variable 'x' is not available here", "grad"),
        {"kind": "modify_grad", "select": "block1", "op": "expr", "expr": "x * 0"}),
    act("expr_out_keyword", "expr", ("keyword 'out' is not allowed",),
        {"kind": "replace_forward", "type": "ReLU", "expr": "relu(x, out=x)"}),
    act("index_not_literal", "index", ("only integers",),
        {"kind": "modify_output", "select": "block1", "op": "zero", "index": "[x]"}),
    act("index_negative_step", "index", ("slice steps must be positive",),
        {"kind": "modify_output", "select": "block1", "op": "zero", "index": "[::-1]"}),
    act("index_no_brackets", "index", ("must be written in brackets",),
        {"kind": "modify_output", "select": "block1", "op": "zero", "index": ":, 3:5"}),
    # ------------------------------------------------------------ unknown op / fn / callable
    act("op_unknown", "op", ("'scale' is not one of",),
        {"kind": "modify_output", "select": "block1", "op": "scale", "value": 2}),
    act("op_case", "op", ("'Add' is not one of", "Did you mean 'add'?"),
        {"kind": "modify_output", "select": "block1", "op": "Add", "value": 2}),
    act("op_grad_only", "op", ("'clip_norm' is not one of",),
        {"kind": "modify_output", "select": "block1", "op": "clip_norm", "max_norm": 1.0}),
    act("clip_norm_negative", "max_norm", ("-1.0", "> 0"),
        {"kind": "modify_grad", "select": "block1", "op": "clip_norm", "max_norm": -1.0}),
    act("clamp_reversed", "min", ("2.0", "1.0"),
        {"kind": "modify_output", "select": "block1", "op": "clamp", "min": 2.0, "max": 1.0}),
    act("item_negative_input", "item", ("-5", "position from 0", "takes 1 positional input(s): input"),
        {"kind": "modify_input", "select": "block1", "op": "zero", "item": -5}),
    act("item_not_passed", "item", ("input 3 was not passed",),
        {"kind": "modify_input", "select": "block1", "op": "zero", "item": 3}, error=ActionError, at="forward"),
    act("dim_out_of_range", "dim", ("Dimension out of range",),
        {"kind": "modify_output", "select": "block1", "op": "mean_ablate", "dim": 5}, error=ActionError,
        at="forward"),
    act("expr_not_a_tensor", "expr", ("'1'", "int", "tensor"),
        {"kind": "replace_forward", "select": "block1.act", "expr": "1"}, error=ActionError, at="forward"),
    act("from_without_patch", "from", ("only op 'patch' takes from", "'add'"),
        {"kind": "modify_output", "select": "block3", "op": "add", "value": 1,
         "from": {"file": "captures.safetensors", "key": "capture_block3/block3/output"}}),
    act("patch_from_string", "from", ("needs {file: PATH, key: ACTION/MODULE/WHAT}",),
        {"kind": "modify_output", "select": "block3", "op": "patch", "from": "captures.safetensors"}),
    act("forward_fn_typo", "fn", ("'identiy' is not one of", "Did you mean 'identity'?"),
        {"kind": "replace_forward", "type": "ReLU", "fn": "identiy"}),
    act("fn_import_missing", "fn", ("cannot import 'no_such_pkg.mod'", "No module named 'no_such_pkg'"),
        {"kind": "modify_output", "select": "block1", "op": "fn", "fn": "no_such_pkg.mod:f"}),
    act("fn_attr_missing", "fn", ("has no 'no_such_fn'",),
        {"kind": "modify_output", "select": "block1", "op": "fn", "fn": "torch:no_such_fn"}),
    act("with_target_missing", "with", ("torch.nn.NoSuchLayer",),
        {"kind": "replace_module", "type": "ReLU", "with": {"_target_": "torch.nn.NoSuchLayer"}}),
    act("with_not_a_module", "with", ("'torch.nn.init.calculate_gain' built a float, not a Module",),
        {"kind": "replace_module", "type": "ReLU",
         "with": {"_target_": "torch.nn.init.calculate_gain", "nonlinearity": "relu"}}),
    act("with_missing_arguments", "with", ("cannot build 'torch.nn.Linear'", "in_features"),
        {"kind": "replace_module", "type": "ReLU", "with": {"_target_": "torch.nn.Linear"}}),
    act("with_no_target", "with", ("needs a _target_ node",),
        {"kind": "replace_module", "type": "ReLU", "with": "GELU"}),
    act("replace_root", "select", ("root module has no parent",),
        {"kind": "replace_module", "select": "<root>", "with": {"_target_": "torch.nn.Identity"}}),
    act("replace_nested", "select", ("matches both 'block1' and 'block1.conv'",),
        {"kind": "replace_module", "select": "block1.**", "with": {"_target_": "torch.nn.Identity"}}),
    act("rename_wildcards_differ", "rename", ("same wildcards in the same order",),
        {"kind": "on_load", "rename": {"blocks.*.attn": "layers.attn"}}),
    act("on_load_nothing_to_do", "rename", ("nothing to do",), {"kind": "on_load"}),
    act("on_load_nothing_to_do_ignore_added_false", "rename", ("nothing to do", "ignore_added"),
        {"kind": "on_load", "ignore_added": False}),
    run("safe_refuses_import_path", "actions.a.fn", ("refused because safe=true",), *CNN, "safe=true",
        "+actions.a={kind:modify_output,select:block1,op:fn,fn:'torch:load'}"),
    run("safe_refuses_torch_load", "actions.a.with._target_",
        ("'torch.load' is not on the safe-mode allowlist", "torch.nn module classes", "set safe=false"), *CNN,
        "safe=true", "+actions.a={kind:replace_module,type:ReLU,with:{_target_:torch.load,f:a.pt,weights_only:false}}"),
    # ------------------------------------------------------------ patch source missing or mis-shaped
    act("patch_file_missing", "from.file", ("'nowhere.safetensors' does not exist",),
        {"kind": "modify_output", "select": "block3", "op": "patch",
         "from": {"file": "nowhere.safetensors", "key": "capture_block3/block3/output"}}),
    act("patch_key_missing", "from.key",
        ("'capture_block3/block2/output' is not in", "Did you mean", "capture_block3/block3/output"),
        {"kind": "modify_output", "select": "block3", "op": "patch",
         "from": {"file": "captures.safetensors", "key": "capture_block3/block2/output"}}, files="captures"),
    act("patch_from_no_key", "from", ("needs {file: PATH, key: ACTION/MODULE/WHAT}",),
        {"kind": "modify_output", "select": "block3", "op": "patch", "from": {"file": "captures.safetensors"}}),
    act("patch_file_corrupt", "from.file", ("cannot read 'captures.safetensors' as safetensors",),
        {"kind": "modify_output", "select": "block3", "op": "patch",
         "from": {"file": "captures.safetensors", "key": "capture_block3/block3/output"}}, files="corrupt_captures"),
    act("patch_shape", "from", ("[2, 32, 4, 4]", "[2, 32, 3, 3]"),
        {"kind": "modify_output", "select": "block3", "op": "patch",
         "from": {"file": "captures.safetensors", "key": "capture_block3/block3/output"}},
        files="misshaped_captures"),
    # ------------------------------------------------------------ checkpoints
    run("checkpoint_missing", "model.checkpoint", ("'nowhere.pt' does not exist",), *CNN, "+actions=linearize",
        "model.checkpoint=nowhere.pt"),
    run("checkpoint_truncated", "model.checkpoint", ("cannot read 'ckpt.safetensors'",), *CNN, "+actions=linearize",
        "model.checkpoint=ckpt.safetensors", files="truncated_safetensors"),
    run("checkpoint_corrupt", "model.checkpoint", ("cannot read 'ckpt.pt'", "Only tensors are accepted"), *CNN,
        "+actions=linearize", "model.checkpoint=ckpt.pt", files="corrupt_pt"),
    run("checkpoint_pickled_object", "model.checkpoint",
        ("cannot read 'ckpt.pt'", "Unsupported global", "tests.bad_inputs.files.Pickled", "weights_only=True"), *CNN,
        "+actions=linearize", "model.checkpoint=ckpt.pt", files="pickled_object_pt"),
    run("checkpoint_plain_pickle", "model.checkpoint", ("cannot read 'ckpt.pt'", "Unsupported operand"), *CNN,
        "+actions=linearize", "model.checkpoint=ckpt.pt", files="plain_pickle_pt"),
    run("checkpoint_wrong_keys", "model.checkpoint",
        ("does not fit the model", "missing keys: block1.conv.weight", "unexpected keys: encoder.weight"),
        *CNN, "+actions=linearize", "model.checkpoint=ckpt.pt", files="wrong_keys_pt"),
    run("checkpoint_wrong_shapes", "model.checkpoint",
        ("does not fit the model", "classifier.1.weight", "[5, 288]", "[10, 288]"),
        *CNN, "+actions=linearize", "model.checkpoint=ckpt.safetensors", files="wrong_shapes_safetensors"),
    run("checkpoint_list", "model.checkpoint", ("holds a list",), *CNN, "+actions=linearize",
        "model.checkpoint=ckpt.pt", files="list_pt"),
    run("checkpoint_suffix", "model.checkpoint", ("'ckpt.ckpt' is not one of .safetensors, .pt",), *CNN,
        "+actions=linearize", "model.checkpoint=ckpt.ckpt", files="wrong_suffix"),
    run("checkpoint_directory", "model.checkpoint", ("'ckpt.pt' is a directory",), *CNN, "+actions=linearize",
        "model.checkpoint=ckpt.pt", files="checkpoint_dir"),
    # ------------------------------------------------------------ input files
    run("input_missing", "input.path", ("'nowhere.pt' does not exist",), *CNN, "+actions=linearize", "+input=file",
        "input.path=nowhere.pt"),
    run("input_wrong_shape", "input.path", ("holds a tensor of shape [3, 5]", "[batch, 1, 28, 28]"), *CNN,
        "+actions=linearize", "+input=file", "input.path=digit.pt", files="wrong_shape_input"),
    run("input_corrupt_npy", "input.path", ("cannot read 'digit.npy' as .npy",), *CNN, "+actions=linearize",
        "+input=file", "input.path=digit.npy", files="corrupt_npy"),
    run("input_object_npy", "input.path", ("cannot read 'digit.npy' as .npy",), *CNN, "+actions=linearize",
        "+input=file", "input.path=digit.npy", files="object_npy"),
    run("input_suffix", "input.path", ("'digit.txt' is not one of .pt",), *CNN, "+actions=linearize", "+input=file",
        "input.path=digit.txt", files="text_input"),
    run("input_corrupt_png", "input.path", ("cannot read 'digit.png'",), *CNN, "+actions=linearize", "+input=file",
        "input.path=digit.png", files="corrupt_png"),
    run("input_png_bomb", "input.path", ("'digit.png' declares a 20000×20000 image", "at most 16384 pixels a side"),
        *CNN, "+actions=linearize", "+input=file", "input.path=digit.png", files="bomb_png"),
    run("input_batches_zero", "input.batches", ("must be a positive int (1 or more), got 0",), *CNN,
        "+actions=linearize", "+input.batches=0"),
    run("input_key_missing", "input.key", ("'img' is not in 'digit.safetensors'", "keys: image"), *CNN,
        "+actions=linearize", "+input=file", "input.path=digit.safetensors", "input.key=img", files="input_dict"),
    run("input_kind", "input.kind", ("'noise' is not one of random, tokens",), *CNN, "+actions=linearize",
        "+input.kind=noise"),
    run("input_unknown_key", "input.shap", ("unknown key", "shape"), *CNN, "+actions=linearize", "+input.shap=[1]"),
    run("input_shape_negative", "input.shape", ("non-negative ints", "-1"), *CNN, "+actions=linearize",
        "model.input.shape=[2,-1,28,28]"),
    run("input_shape_wrong_for_model", "input", ("fails on this input before any surgery", "[2, 3, 28, 28]"), *CNN,
        "+actions=linearize", "model.input.shape=[2,3,28,28]"),
    run("input_count_wrong", "input", ("fails on this input before any surgery", "'x2'"), "+model=functions",
        "+actions=add_five", "model.input.shapes=[[2,1]]"),
    run("expr_changes_shape", "", ("RuntimeError", "block1.act"), *CNN,
        "+actions.a={kind:replace_forward,select:block1.act,expr:'x.sum()'}", error=SurgeryError, at="forward"),
    run("loss_needs_target", "loss", ("needs a class index", "input.target"), *CNN, "+actions=linearize",
        "backward=true", "loss=cross_entropy", "model.input.target=null"),
    run("target_out_of_range", "input.target", ("class 12 does not fit an output of shape [2, 10]",), *CNN,
        "+actions=linearize", "backward=true", "loss=cross_entropy", "model.input.target=12"),
    # ------------------------------------------------------------ model and actions names
    run("model_unknown", "model", ("resnet", "cnn"), "+model=resnet", hydra=True),
    run("actions_unknown", "actions", ("linearise",), *CNN, "+actions=linearise", hydra=True),
    run("run_setting_without_plus", "sede", ("Could not override 'sede'",), *CNN, "sede=3", hydra=True),
    run("model_target_typo", "model", ("cannot build 'surgery.models.cnn.CNNN'", "no attribute 'CNNN'"), *CNN,
        "model._target_=surgery.models.cnn.CNNN"),
    run("model_bad_argument", "model", ("cannot build 'surgery.models.cnn.CNN'", "depth"), *CNN, "+model.depth=3"),
    run("model_bad_value", "model", ("activation must be one of",), *CNN, "model.activation=swish"),
    run("model_safe_target", "model._target_", ("refused because safe=true",), *CNN, "safe=true",
        "model._target_=collections.OrderedDict"),
    # ------------------------------------------------------------ run settings
    run("mode_unknown", "mode", ("'train' is not one of run, plan, modules",), *CNN, "mode=train"),
    run("mode_typo", "mode", ("'plans' is not one of", "Did you mean 'plan'?"), *CNN, "mode=plans"),
    run("loss_unknown", "loss", ("'l1' is not one of sum, mse, cross_entropy, kl_div",), *CNN, "loss=l1"),
    run("dtype_unknown", "dtype", ("'float8' is not one of float32, float64",), *CNN, "dtype=float8"),
    run("dtype_int", "dtype", ("'int32' is not one of",), *CNN, "dtype=int32"),
    run("seed_str", "seed", ("'abc'",), *CNN, "seed=abc"),
    run("seed_float", "seed", ("1.5",), *CNN, "seed=1.5"),
    run("strict_str", "strict", ("'maybe'",), *CNN, "strict=maybe"),
    run("device_unknown", "device", ("'tpu' is not cpu, cuda, cuda:N or auto",), *CNN, "device=tpu"),
    run("device_cuda_no_gpu", "device", ("'cuda' asked for, but torch sees no CUDA GPU",), *CNN,
        "+actions=linearize", "device=cuda"),
    run("device_cuda_bad_index", "device", ("'cuda:99'",), *CNN, "+actions=linearize", "device=cuda:99",
        xfail="on a machine with a GPU, device=cuda:99 is not checked against torch.cuda.device_count(): the model's"
        " .to() raises torch's 'invalid device ordinal' error, exit 1 (predicted; this task had no GPU to confirm)"
        if torch.cuda.is_available() else None),
    # ------------------------------------------------------------ two actions that cannot both hold
    run("same_name_added_twice", "actions.second.name", ("already has an attribute 'g'",), *CNN,
        "+actions.first={kind:add_parameter,select:block1.conv,name:g,shape:[2]}",
        "+actions.second={kind:add_parameter,select:block1.conv,name:g,shape:[2]}"),
]  # fmt: skip


def by_id(case_id: str) -> Case:
    """The case named ``case_id``."""
    return next(c for c in CASES if c.id == case_id)
