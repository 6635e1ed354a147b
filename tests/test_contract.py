"""Every registered kind honours the contract on several small models (PEFT-style table):
plan → apply → forward (+ backward) → the kind's effect equals the same thing written in plain
PyTorch, bit for bit → remove → the model equals a full independent snapshot of before."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import surgery
from surgery.actions import KINDS
from surgery.files.tensors import read_tensors
from tests.conftest import Snapshot, TinyNet
from tests.splice_helpers import hand_decode, hand_encode, sae_tensors, write_plain


class MLP(nn.Module):
    """fc1 → relu → fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Two-head causal self-attention written out (nn.MultiheadAttention never calls its out_proj as a module)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """fc → gelu → proj."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, 2)
        self.ln2, self.mlp = nn.LayerNorm(dim), FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """in-projection → one block → final norm → head, over (batch, time, 5) inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 8)
        self.block = Block(8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.block(self.proj(x))))


@dataclass(frozen=True)
class Model:
    """A model and the names its cases use: a Linear (``lin``), an activation (``act``) and a module whose
    gradient is changed (``grad``: not an in-place one, where PyTorch refuses full backward hooks)."""

    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    lin: str
    act: str
    grad: str


MODELS = {
    "mlp": Model(MLP, (4, 6), "fc1", "act", "act"),
    "cnn": Model(TinyNet, (2, 1, 6, 6), "fc", "act", "pool"),  # act is ReLU(inplace=True)
    "transformer": Model(TinyTransformer, (2, 5, 5), "block.mlp.fc", "block.mlp.act", "block.mlp.act"),
}


def config(case: str, m: Model) -> dict[str, Any]:
    """The case's action for model ``m``."""
    return {
        "init": {"kind": "init", "select": m.lin, "param": "weight", "method": "constant", "value": 0.25},
        "add_parameter": {"kind": "add_parameter", "select": m.lin, "name": "scale", "like": "bias",
                          "init": {"method": "ones"}},
        "add_buffer": {"kind": "add_buffer", "select": m.lin, "name": "mask", "shape": [3], "init": {"method": "ones"}},
        "freeze": {"kind": "freeze", "select": m.lin, "param": "*"},
        "unfreeze": {"kind": "unfreeze", "select": m.lin, "param": "weight"},
        "replace_forward": {"kind": "replace_forward", "select": m.act, "expr": "x * sigmoid(x)"},
        "modify_output": {"kind": "modify_output", "select": m.lin, "op": "mul", "value": 0.5, "index": "[:, :2]"},
        "modify_input": {"kind": "modify_input", "select": m.lin, "op": "add", "value": 1.0},
        "capture": {"kind": "capture", "select": m.lin, "what": ["input", "output"]},
        "capture/output": {"kind": "capture", "select": m.lin},
        "capture_grad": {"kind": "capture_grad", "select": m.lin},
        "capture_grad/param": {"kind": "capture_grad", "select": m.lin, "param": "weight"},
        "modify_grad": {"kind": "modify_grad", "select": m.grad, "op": "clip_value", "value": 0.01},
        "modify_grad/param": {"kind": "modify_grad", "select": m.lin, "param": "*", "op": "mul", "value": 0.5},
        "log": {"kind": "log", "select": m.lin},
        "replace_module": {"kind": "replace_module", "select": m.act, "with": {"_target_": "torch.nn.Tanh"}},
        "on_load": {"kind": "on_load", "rename": {"old.*": f"{m.lin}.*"}},
        "splice": {"kind": "splice", "select": m.lin, "module": {"path": sae_for(m)}, "capture": True,
                   "features": {"index": [0], "op": "mul", "value": 2.0}},
        "lora": {"kind": "lora", "select": m.lin, "r": 2, "alpha": 3.0},
        "splice/train": {"kind": "splice", "select": m.lin, "module": {"path": sae_for(m)}, "train": True},
    }[case]  # fmt: skip


_SAE_DIR = Path(tempfile.mkdtemp(prefix="surgery-contract-sae-"))


def sae_for(m: Model) -> str:
    """A plain .safetensors SAE as wide as ``m.lin``'s output (written once per width, for the splice case)."""
    width = m.build().get_submodule(m.lin).out_features
    path = _SAE_DIR / f"sae{width}.safetensors"
    if not path.exists():
        write_plain(path, sae_tensors(width, 2 * width))
    return str(path)


CASE_NAMES = [
    "init", "add_parameter", "add_buffer", "freeze", "unfreeze", "replace_forward", "modify_output", "modify_input",
    "capture", "capture/output", "capture_grad", "capture_grad/param", "modify_grad", "modify_grad/param", "log",
    "replace_module", "on_load", "splice", "splice/train", "lora",
]  # fmt: skip
CASES = {case: config(case, MODELS["cnn"]) for case in CASE_NAMES}  # the TinyNet table (test_faults uses it)


def run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """Forward and backward of the output sum: output, input gradient, every parameter's gradient."""
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def assert_runs_equal(a: tuple, b: tuple) -> None:
    """Outputs, input gradients and parameter gradients are bit-identical (None where the other is None)."""
    assert torch.equal(a[0], b[0]), "outputs differ"
    assert torch.equal(a[1], b[1]), "input gradients differ"
    assert a[2].keys() == b[2].keys()
    for name, grad in a[2].items():
        other = b[2][name]
        assert (grad is None) == (other is None), name
        assert grad is None or torch.equal(grad, other), name


def replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


class SiLUExpr(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


# ---------------------------------------------------------------- each kind's effect, against plain PyTorch
# effect(model surgered, ref: an untouched copy, x, m, s: the Surgery, capsys); each runs forward/backward itself


def effect_init(model, ref, x, m, s, capsys) -> None:
    assert torch.equal(model.get_submodule(m.lin).weight, torch.full_like(ref.get_submodule(m.lin).weight, 0.25))
    with torch.no_grad():
        ref.get_submodule(m.lin).weight.fill_(0.25)
    assert_runs_equal(run(model, x), run(ref, x))


def effect_add_tensor(model, ref, x, m, s, capsys, name: str, kind: str) -> None:
    lin = model.get_submodule(m.lin)
    tensor = getattr(lin, name)
    if kind == "parameter":
        assert isinstance(tensor, nn.Parameter) and tensor.requires_grad
        assert torch.equal(tensor, torch.ones_like(lin.bias))
        assert f"{m.lin}.{name}" in dict(model.named_parameters())
    else:
        assert tensor.shape == (3,) and torch.equal(tensor, torch.ones_like(tensor))
        assert f"{m.lin}.{name}" in dict(model.named_buffers())
    assert f"{m.lin}.{name}" in model.state_dict()
    out, xg, grads = run(model, x)  # nothing else changes: the new tensor is not used by forward
    ref_out, ref_xg, ref_grads = run(ref, x)
    assert torch.equal(out, ref_out) and torch.equal(xg, ref_xg)
    assert grads.pop(f"{m.lin}.{name}", None) is None and grads.keys() == ref_grads.keys()


def effect_freeze(model, ref, x, m, s, capsys) -> None:
    assert not any(p.requires_grad for p in model.get_submodule(m.lin).parameters())
    ref.get_submodule(m.lin).requires_grad_(False)
    result = run(model, x)
    assert result[2][f"{m.lin}.weight"] is None and result[2][f"{m.lin}.bias"] is None
    assert_runs_equal(result, run(ref, x))


def effect_unfreeze(model, ref, x, m, s, capsys) -> None:
    assert model.get_submodule(m.lin).weight.requires_grad
    ref.get_submodule(m.lin).weight.requires_grad_(True)
    result = run(model, x)
    assert result[2][f"{m.lin}.weight"] is not None
    assert_runs_equal(result, run(ref, x))


def effect_replace_forward(model, ref, x, m, s, capsys) -> None:
    replace(ref, m.act, SiLUExpr())
    assert_runs_equal(run(model, x), run(ref, x))


def effect_modify_output(model, ref, x, m, s, capsys) -> None:
    def half(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        out = output.clone()
        out[:, :2] = output[:, :2] * 0.5
        return out

    ref.get_submodule(m.lin).register_forward_hook(half)
    assert_runs_equal(run(model, x), run(ref, x))


def effect_splice(model, ref, x, m, s, capsys) -> None:
    t = read_tensors(Path(sae_for(m)), "sae")

    def spliced(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        on = {k: v.to(output.device) for k, v in t.items()}  # the SAE computes in its own dtype, on the model's device
        f, _ = hand_encode(on, output.to(on["W_enc"].dtype))
        f2 = f.clone()
        f2[..., 0] = f[..., 0] * 2.0
        return hand_decode(on, f2).to(output.dtype)

    ref.get_submodule(m.lin).register_forward_hook(spliced)
    assert_runs_equal(run(model, x), run(ref, x))
    assert s.captures["act"][m.lin].features.shape[-1] == 2 * t["W_enc"].shape[0]


def effect_splice_train(model, ref, x, m, s, capsys) -> None:
    names = ("W_enc", "b_enc", "W_dec", "b_dec")
    t = {n: v.requires_grad_(True) for n, v in read_tensors(Path(sae_for(m)), "sae").items()}
    lin = model.get_submodule(m.lin)
    assert all(isinstance(getattr(lin, n), nn.Parameter) and torch.equal(getattr(lin, n), t[n]) for n in names)
    assert sorted(s.added_state_dict()) == sorted(f"{m.lin}.{n}" for n in names)

    def spliced(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return hand_decode(t, hand_encode(t, output)[0])

    ref.get_submodule(m.lin).register_forward_hook(spliced)
    out, xg, grads = run(model, x)
    ref_out, ref_xg, ref_grads = run(ref, x)
    assert torch.equal(out, ref_out) and torch.equal(xg, ref_xg)
    for n in names:  # the SAE's parameters get the gradient the hand-written SAE's tensors get
        assert torch.equal(grads.pop(f"{m.lin}.{n}"), t[n].grad), n
    assert grads.keys() == ref_grads.keys() and all(torch.equal(g, ref_grads[n]) for n, g in grads.items())


def effect_lora(model, ref, x, m, s, capsys) -> None:
    lin = model.get_submodule(m.lin)
    a, b = lin.lora_A, lin.lora_B
    assert isinstance(a, nn.Parameter) and a.requires_grad and b.requires_grad
    assert a.shape == (2, lin.in_features) and torch.equal(b, torch.zeros(lin.out_features, 2))  # B starts at zero
    bound = 1 / lin.in_features**0.5  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)), as PEFT's A
    assert 0 < a.abs().max() <= bound
    with torch.no_grad():
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(2)))
    a2, b2 = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    lora = lambda mod, args, out: out + F.linear(F.linear(args[0], a2), b2) * 1.5  # noqa: E731 - alpha / r = 1.5
    ref.get_submodule(m.lin).register_forward_hook(lora)
    out, xg, grads = run(model, x)
    ref_out, ref_xg, ref_grads = run(ref, x)
    assert torch.equal(out, ref_out) and torch.equal(xg, ref_xg)
    assert torch.equal(grads.pop(f"{m.lin}.lora_A"), a2.grad) and torch.equal(grads.pop(f"{m.lin}.lora_B"), b2.grad)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    assert set(s.added_state_dict()) == {f"{m.lin}.lora_A", f"{m.lin}.lora_B"}


def effect_modify_input(model, ref, x, m, s, capsys) -> None:
    ref.get_submodule(m.lin).register_forward_pre_hook(lambda mod, args: (args[0] + 1.0,))
    assert_runs_equal(run(model, x), run(ref, x))


def _seen(ref: nn.Module, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    ref.get_submodule(name).register_forward_hook(lambda mod, args, out: seen.append((args[0].detach(), out.detach())))
    return seen


def effect_capture(model, ref, x, m, s, capsys) -> None:
    seen = _seen(ref, m.lin)
    for _ in range(2):  # two calls: both are kept, in order
        assert torch.equal(model(x), ref(x))
    calls = s.captures["act"][m.lin].calls
    assert len(calls) == 2 == len(seen)
    for call, (inp, out) in zip(calls, seen, strict=True):
        assert torch.equal(call.input[0], inp) and torch.equal(call.output, out)


def effect_capture_output(model, ref, x, m, s, capsys) -> None:
    seen = _seen(ref, m.lin)
    for _ in range(2):
        assert torch.equal(model(x), ref(x))
    calls = s.captures["act"][m.lin].calls
    assert [c.output.shape for c in calls] == [o.shape for _, o in seen] and len(calls) == 2
    assert all(torch.equal(c.output, o) for c, (_, o) in zip(calls, seen, strict=True))


def effect_capture_grad(model, ref, x, m, s, capsys) -> None:
    seen: list[tuple] = []
    ref.get_submodule(m.lin).register_full_backward_hook(lambda mod, gi, go: seen.append((gi, go)))
    assert_runs_equal(run(model, x), run(ref, x))
    (call,) = s.captures["act"][m.lin].calls
    ((gi, go),) = seen
    assert torch.equal(call.grad_output[0], go[0]) and torch.equal(call.grad_input[0], gi[0])


def effect_capture_grad_param(model, ref, x, m, s, capsys) -> None:
    result = run(model, x)
    assert_runs_equal(result, run(ref, x))
    (call,) = s.captures["act"][f"{m.lin}.weight"].calls
    assert torch.equal(call.grad, result[2][f"{m.lin}.weight"])


def effect_modify_grad(model, ref, x, m, s, capsys) -> None:
    def clip(mod: nn.Module, gi: tuple, go: tuple) -> tuple:
        return tuple(None if g is None else g.clamp(-0.01, 0.01) for g in gi)

    ref.get_submodule(m.grad).register_full_backward_hook(clip)
    assert_runs_equal(run(model, x), run(ref, x))


def effect_modify_grad_param(model, ref, x, m, s, capsys) -> None:
    for p in ref.get_submodule(m.lin).parameters():
        p.register_hook(lambda g: g * 0.5)
    assert_runs_equal(run(model, x), run(ref, x))


def effect_log(model, ref, x, m, s, capsys) -> None:
    capsys.readouterr()
    seen = _seen(ref, m.lin)
    assert torch.equal(model(x), ref(x))
    ((inp, out),) = seen
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[act] {m.lin} (Linear): in ({described(inp)}) -> out {described(out)}"]


def described(t: torch.Tensor) -> str:
    """What log prints for a tensor: shape, then mean, std, min and max (in float32) to 4 significant digits."""
    t = t.float()
    stats = f"mean={t.mean().item():.4g} std={t.std().item():.4g} min={t.min().item():.4g} max={t.max().item():.4g}"
    return f"{tuple(t.shape)} {stats}"


def effect_replace_module(model, ref, x, m, s, capsys) -> None:
    assert type(model.get_submodule(m.act)) is nn.Tanh
    replace(ref, m.act, nn.Tanh())
    assert_runs_equal(run(model, x), run(ref, x))


def effect_on_load(model, ref, x, m, s, capsys) -> None:
    state = {k: v + 1 if k.startswith(m.lin + ".") else v for k, v in ref.state_dict().items()}
    renamed = {("old" + k[len(m.lin) :] if k.startswith(m.lin + ".") else k): v for k, v in state.items()}
    s.load_state_dict(renamed)  # strict: the renamed keys land where they belong
    ref.load_state_dict(state)
    assert torch.equal(model.get_submodule(m.lin).weight, state[f"{m.lin}.weight"])
    assert_runs_equal(run(model, x), run(ref, x))


EFFECTS: dict[str, Callable[..., None]] = {
    "init": effect_init,
    "add_parameter": lambda *a: effect_add_tensor(*a, name="scale", kind="parameter"),
    "add_buffer": lambda *a: effect_add_tensor(*a, name="mask", kind="buffer"),
    "freeze": effect_freeze,
    "unfreeze": effect_unfreeze,
    "replace_forward": effect_replace_forward,
    "modify_output": effect_modify_output,
    "modify_input": effect_modify_input,
    "capture": effect_capture,
    "capture/output": effect_capture_output,
    "capture_grad": effect_capture_grad,
    "capture_grad/param": effect_capture_grad_param,
    "modify_grad": effect_modify_grad,
    "modify_grad/param": effect_modify_grad_param,
    "log": effect_log,
    "replace_module": effect_replace_module,
    "on_load": effect_on_load,
    "splice": effect_splice,
    "splice/train": effect_splice_train,
    "lora": effect_lora,
}


def prepared(name: str, case: str) -> tuple[nn.Module, torch.Tensor]:
    """A seeded model in eval mode and its input; for unfreeze, the weight starts frozen."""
    m = MODELS[name]
    torch.manual_seed(0)
    model = m.build().eval()
    if case == "unfreeze":
        model.get_submodule(m.lin).weight.requires_grad_(False)
    return model, torch.randn(m.shape, generator=torch.Generator().manual_seed(1))


TABLE = [(name, case) for name in MODELS for case in CASE_NAMES]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: torch's intra-op threads only cost here (tens of times slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_registered_kind_has_a_contract_case_with_an_effect() -> None:
    assert {case.split("/")[0] for case in CASE_NAMES} == set(KINDS.names())
    assert set(EFFECTS) == set(CASE_NAMES)


@pytest.mark.parametrize(("model_name", "case"), TABLE, ids=[f"{n}-{c}" for n, c in TABLE])
def test_contract(model_name: str, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    model, x = prepared(model_name, case)
    m = MODELS[model_name]
    before = Snapshot.of(model)
    reference = run(model, x)
    ref = copy.deepcopy(model)  # the plain-PyTorch twin the effect is written on
    plan = surgery.plan(model, {"act": config(case, m)})
    before.assert_same(model)  # planning touches nothing
    with surgery.apply(model, plan, verify=True) as s:  # remove(verify) is the engine's own check, too
        EFFECTS[case](model, ref, x, m, s, capsys)
    before.assert_same(model)
    assert_runs_equal(run(model, x), reference)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_contract_twice_in_a_row(case: str) -> None:
    """Applying, removing and applying again gives the same output both times."""
    model, x = prepared("transformer", case)
    outs = []
    for _ in range(2):
        with surgery.apply(model, {"act": config(case, MODELS["transformer"])}):
            outs.append(model(x).detach())
    assert torch.equal(outs[0], outs[1])
