"""The 13 tasks of issue 16, taken from the peers' tutorials and tests (PyTorch's hook tests, TransformerLens,
nnsight, baukit, torchdistill, torch.nn.utils.prune): each is one dict recipe with no Python glue in the hooks,
checked against the same task written by hand with plain PyTorch hooks, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn

import surgery


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Keyed(nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x * 3


def test_1_forward_hook_adds_a_keyword_input() -> None:
    """PyTorch test_forward_hooks (with_kwargs): ``out + kwargs['bias']``."""
    module, x, bias = Keyed(), torch.randn(2, 5, generator=_gen(0)), torch.randn(5, generator=_gen(1))
    h = module.register_forward_hook(lambda m, a, k, o: o + k["bias"], with_kwargs=True)
    expected = module(x, bias=bias)
    h.remove()
    recipe = {"k": {"kind": "replace_forward", "select": "<root>", "expr": "output + kwargs['bias']"}}
    with surgery.apply(module, recipe, verify=True):
        assert torch.equal(module(x, bias=bias), expected)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    model(x).square().sum().backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()] + [x.grad]


def test_2_zero_grad_output_in_a_backward_pre_hook() -> None:
    """PyTorch test_full_backward_pre_hooks: a pre-hook returning zeros zeroes the module's own parameter grads."""
    model, x = _mlp(), torch.randn(4, 5, generator=_gen(2))
    hand = copy.deepcopy(model)
    hand[2].register_full_backward_pre_hook(lambda m, go: (torch.zeros_like(go[0]),))
    expected = _grads(hand, x)
    recipe = {"z": {"kind": "modify_grad", "select": "2", "what": "grad_output", "op": "zero"}}
    with surgery.apply(model, recipe, verify=True):
        got = _grads(model, x)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert not got[2].any() and not got[3].any()  # the module's own weight and bias


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x))


def test_3_modify_only_the_second_call_of_a_module() -> None:
    model, x = Shared(), torch.randn(2, 4, generator=_gen(3))
    count = [0]

    def second(m: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor | None:
        count[0] += 1
        return o * -1.0 if count[0] == 2 else None

    hand = copy.deepcopy(model)
    hand.lin.register_forward_hook(second)
    expected = hand(x)
    recipe = {"neg": {"kind": "modify_output", "select": "lin", "op": "mul", "value": -1.0, "calls": [1]}}
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), expected)


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad input")


def test_4_capture_the_input_of_a_module_whose_forward_raises() -> None:
    module, x = Fails(), torch.randn(2, 3, generator=_gen(4))
    recipe = {"c": {"kind": "capture", "select": "<root>", "what": ["input"], "always": True}}
    with surgery.apply(module, recipe, verify=True) as s:
        with pytest.raises(ValueError, match="bad input"):
            module(x)
        assert torch.equal(s.captures["c"]["<root>"].input[0], x)


def test_5_run_before_a_hook_already_on_the_module() -> None:
    model, x = _mlp(), torch.randn(4, 5, generator=_gen(5))
    model[0].register_forward_hook(lambda m, a, o: o.relu())  # the user's hook, already there
    hand = copy.deepcopy(model)
    hand[0].register_forward_hook(lambda m, a, o: o - 0.5, prepend=True)
    expected = hand(x)
    recipe = {"first": {"kind": "modify_output", "select": "0", "op": "add", "value": -0.5, "prepend": True}}
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(x), expected)


def _gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    from surgery.models.hf import gpt2_tiny

    torch.manual_seed(0)
    return gpt2_tiny(n_layer=2)


def _logit_diff(output: object) -> torch.Tensor:
    logits = output.logits  # type: ignore[attr-defined]
    return logits[:, -1, 3] - logits[:, -1, 7]


def test_6_residual_stream_patching_over_every_layer_and_position() -> None:
    """TransformerLens' activation patching: clean block output at (layer, position) into the corrupted run."""
    model = _gpt2()
    clean, corrupt = torch.randint(0, 100, (1, 4), generator=_gen(6)), torch.randint(0, 100, (1, 4), generator=_gen(7))
    for layer in range(2):
        block = model.transformer.h[layer]
        store: list[torch.Tensor] = []
        h = block.register_forward_hook(lambda m, a, o, store=store: store.append(o.detach()))
        model(clean)
        h.remove()
        for pos in range(4):

            def patch(
                m: nn.Module, a: tuple, o: torch.Tensor, pos: int = pos, clean_out: torch.Tensor = store[0]
            ) -> torch.Tensor:
                o = o.clone()
                o[:, pos] = clean_out[:, pos]
                return o

            h = block.register_forward_hook(patch)
            expected = _logit_diff(model(corrupt))
            h.remove()
            name = f"transformer.h.{layer}"
            recipe = {
                "clean": {"kind": "capture", "select": name},
                "patch": {"kind": "modify_output", "select": name, "op": "patch", "from": {"capture": "clean"},
                          "index": f"[:, {pos}]"},
            }  # fmt: skip
            with surgery.apply(model, recipe, verify=True) as s:
                with s.source_pass():
                    model(clean)
                assert torch.equal(_logit_diff(model(corrupt)), expected)


def test_7_mean_ablate_one_head_with_the_mean_of_a_reference_batch() -> None:
    """Head 0 of block 0 (the first 16 features entering attn.c_proj) set to its mean over a reference batch."""
    model = _gpt2()
    ref, x = torch.randint(0, 100, (3, 5), generator=_gen(8)), torch.randint(0, 100, (2, 5), generator=_gen(9))
    proj = model.transformer.h[0].attn.c_proj
    store: list[torch.Tensor] = []
    h = proj.register_forward_pre_hook(lambda m, a: store.append(a[0][:, :, 0:16].detach()))
    model(ref)
    h.remove()
    mean = store[0].mean(dim=0, keepdim=True)

    def ablate(m: nn.Module, a: tuple) -> tuple:
        z = a[0].clone()
        z[:, :, 0:16] = mean
        return (z,)

    h = proj.register_forward_pre_hook(ablate)
    expected = model(x)
    h.remove()
    recipe = {
        "ref": {"kind": "capture", "select": "transformer.h.0.attn.c_proj", "what": ["input"], "index": "[:, :, 0:16]"},
        "ablate": {"kind": "modify_input", "select": "transformer.h.0.attn.c_proj", "op": "set",
                   "from": {"capture": "ref", "what": "input", "reduce": "mean", "dim": 0}, "index": "[:, :, 0:16]"},
    }  # fmt: skip
    with surgery.apply(model, recipe, verify=True) as s:
        with s.source_pass():
            model(ref)
        assert torch.equal(model(x).logits, expected.logits)


def test_8_logit_lens() -> None:
    """Final norm and unembedding applied to each block's output."""
    model = _gpt2()
    ids = torch.randint(0, 100, (1, 5), generator=_gen(10))
    outs: list[torch.Tensor] = []
    hs = [b.register_forward_hook(lambda m, a, o: outs.append(o.detach())) for b in model.transformer.h]
    model(ids)
    for h in hs:
        h.remove()
    expected = [model.lm_head(model.transformer.ln_f(o)) for o in outs]

    def lens(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return model.lm_head(model.transformer.ln_f(output))

    recipe = {"lens": {"kind": "capture", "select": "transformer.h.*", "fn": lens}}
    with surgery.apply(model, recipe, verify=True) as s:
        model(ids)
        got = [s.captures["lens"][f"transformer.h.{i}"].output for i in range(2)]
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_9_patch_one_blocks_output_at_one_token() -> None:
    model = _gpt2()
    clean, corrupt = (
        torch.randint(0, 100, (1, 5), generator=_gen(11)),
        torch.randint(0, 100, (1, 5), generator=_gen(12)),
    )
    block = model.transformer.h[1]
    store: list[torch.Tensor] = []
    h = block.register_forward_hook(lambda m, a, o: store.append(o.detach()))
    model(clean)
    h.remove()

    def patch(m: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        o = o.clone()
        o[:, 2] = store[0][:, 2]
        return o

    h = block.register_forward_hook(patch)
    expected = model(corrupt)
    h.remove()
    recipe = {
        "clean": {"kind": "capture", "select": "transformer.h.1", "index": "[:, 2]"},
        "patch": {"kind": "modify_output", "select": "transformer.h.1", "op": "patch", "from": {"capture": "clean"},
                  "index": "[:, 2]"},
    }  # fmt: skip
    with surgery.apply(model, recipe, verify=True) as s:
        with s.source_pass():
            model(clean)
        assert torch.equal(model(corrupt).logits, expected.logits)


def test_10_attribution_patching_activation_times_gradient() -> None:
    """Each block's output and the gradient of the logit difference with respect to it, captured in one pass."""
    model = _gpt2()
    ids = torch.randint(0, 100, (1, 5), generator=_gen(13))
    acts: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    hs = [b.register_forward_hook(lambda m, a, o: acts.append(o.detach())) for b in model.transformer.h]
    hs += [b.register_full_backward_pre_hook(lambda m, go: grads.append(go[0].clone())) for b in model.transformer.h]
    _logit_diff(model(ids)).sum().backward()
    for h in hs:
        h.remove()
    for b in model.transformer.h:
        b._is_full_backward_hook = None
    expected = {0: acts[0] * grads[1], 1: acts[1] * grads[0]}  # backward runs the blocks in reverse
    model.zero_grad(set_to_none=True)
    recipe = {
        "act": {"kind": "capture", "select": "transformer.h.*"},
        "grad": {"kind": "capture_grad", "select": "transformer.h.*", "what": "grad_output"},
    }
    with surgery.apply(model, recipe, verify=True) as s:
        _logit_diff(model(ids)).sum().backward()
        for i in range(2):
            name = f"transformer.h.{i}"
            score = s.captures["act"][name].output * s.captures["grad"][name].grad_output[0]
            assert torch.equal(score, expected[i])
    model.zero_grad(set_to_none=True)


def test_11_add_a_given_steering_vector_at_one_position() -> None:
    model = _gpt2()
    ids, vec = torch.randint(0, 100, (2, 5), generator=_gen(14)), torch.randn(32, generator=_gen(15))

    def steer(m: nn.Module, a: tuple, o: torch.Tensor) -> torch.Tensor:
        o = o.clone()
        o[:, 3] = o[:, 3] + vec
        return o

    h = model.transformer.h[0].register_forward_hook(steer)
    expected = model(ids).logits
    h.remove()
    recipe = {
        "steer": {"kind": "modify_output", "select": "transformer.h.0", "op": "add", "value": vec, "index": "[:, 3]"}
    }
    with surgery.apply(model, recipe, verify=True):
        assert torch.equal(model(ids).logits, expected)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher, self.student = (
            nn.Sequential(nn.Linear(5, 8), nn.ReLU()),
            nn.Sequential(nn.Linear(5, 8), nn.ReLU()),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.teacher(x), self.student(x)


def test_12_distillation_loss_through_captured_student_features() -> None:
    """torchdistill: an MSE between the student's and the teacher's features, backpropagated into the student."""
    model, x = Pair(), torch.randn(4, 5, generator=_gen(16))
    hand = copy.deepcopy(model)
    feats: dict[str, torch.Tensor] = {}
    hand.teacher[0].register_forward_hook(lambda m, a, o: feats.__setitem__("t", o.detach()))
    hand.student[0].register_forward_hook(lambda m, a, o: feats.__setitem__("s", o))
    hand(x)
    F.mse_loss(feats["s"], feats["t"]).backward()
    recipe = {
        "t": {"kind": "capture", "select": "teacher.0"},
        "s": {"kind": "capture", "select": "student.0", "detach": False},
    }
    with surgery.apply(model, recipe, verify=True) as s:
        model(x)
        F.mse_loss(s.captures["s"]["student.0"].output, s.captures["t"]["teacher.0"].output).backward()
    assert torch.equal(model.student[0].weight.grad, hand.student[0].weight.grad)
    assert model.teacher[0].weight.grad is None


def test_13_l1_unstructured_pruning_mask_from_a_kthvalue_threshold() -> None:
    """torch.nn.utils.prune.l1_unstructured(amount=0.5): the half of the weights smallest in |w| are zeroed."""
    torch.manual_seed(0)
    lin, x = nn.Linear(6, 4), torch.randn(3, 6, generator=_gen(17))
    hand = copy.deepcopy(lin)
    torch.nn.utils.prune.l1_unstructured(hand, "weight", amount=0.5)
    expected = hand(x)
    expr = (
        "linear(x, module.weight * (abs(module.weight)"
        " > kthvalue(abs(module.weight).flatten(), module.weight.numel() // 2).values), module.bias)"
    )
    with surgery.apply(lin, {"prune": {"kind": "replace_forward", "select": "<root>", "expr": expr}}, verify=True):
        assert torch.equal(lin(x), expected)
