"""The `noise` stream rebuilt from its documented rule in plain Python/torch, compared bit for bit.

Rule (surgery/actions/noise.py, docs/behaviour.md): the action's key is ``seed_for(seed, name)``; call ``c`` uses
``mix(key + c * GAMMA)`` and element hash ``j`` is ``mix(call_key + j * GAMMA)`` (splitmix64, mod 2**64). float64
takes the top 53 bits of hashes ``[0, pairs)`` for radii and ``[pairs, 2 * pairs)`` for angles; other dtypes the top
and bottom 24 bits of one hash per pair, in float32, then cast. Box–Muller: ``[cos * r, sin * r][:n]``.
Also: replay under activation checkpointing (reentrant or not), its memory bound, and its refusal.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import surgery
from surgery.actions.base import seed_for
from surgery.actions.noise import _Replay, noise_stream, normals

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
REFUSAL = (
    "noise: a forward ran inside the backward pass (activation checkpointing recomputing a region) that matches no"
    " call of the forward pass, so it cannot get the same noise; checkpoint regions that call a noised module at"
    " most once each"
)


def splitmix(z: int) -> int:
    """splitmix64's finaliser, unsigned."""
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def signed(z: int) -> int:
    return z - (1 << 64) if z >> 63 else z


def reference(key: int, call: int, shape: tuple[int, ...], dtype: torch.dtype, std: float = 1.0) -> torch.Tensor:
    """Call ``call`` of the stream ``key`` (63-bit), from the rule alone."""
    n = math.prod(shape)
    pairs = (n + 1) // 2
    call_key = splitmix(key + call * GAMMA)
    wide = dtype == torch.float64
    bits = 53 if wide else 24
    work = torch.float64 if wide else torch.float32
    hashes = [signed(splitmix(call_key + j * GAMMA)) for j in range(2 * pairs if wide else pairs)]
    if wide:
        radius_bits, angle_bits = [h >> 11 for h in hashes[:pairs]], [h >> 11 for h in hashes[pairs:]]
    else:
        radius_bits, angle_bits = [h >> 40 for h in hashes], [h & (2**24 - 1) for h in hashes]
    u = (torch.tensor(radius_bits).to(work) + (2.0 ** (bits - 1) + 1)) * 2.0**-bits  # (0, 1]
    radius = (torch.log(u) * (-2.0 * std * std)).sqrt()
    angle = torch.tensor(angle_bits).to(work) * (2 * math.pi / 2**bits)
    return torch.cat([torch.cos(angle) * radius, torch.sin(angle) * radius])[:n].view(shape).to(dtype)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 6), (3, 5), (1,)])
def test_normals_equal_the_documented_rule_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    key = 0x1234_5678_9ABC_DEF0
    call_key = signed(splitmix(key))
    assert torch.equal(
        normals(torch.Size(shape), dtype, torch.device("cpu"), call_key), reference(key, 0, shape, dtype)
    )
    got = normals(torch.Size(shape), dtype, torch.device("cpu"), call_key, std=0.25)
    assert torch.equal(got, reference(key, 0, shape, dtype, std=0.25))


def test_normals_on_meta_stay_on_meta() -> None:
    """A model on the meta device (shapes only) gets meta noise, not a cpu tensor."""
    out = normals(torch.Size([2, 3]), torch.float32, torch.device("meta"), 5)
    assert out.device.type == "meta" and out.shape == (2, 3)
    assert noise_stream(5)(torch.empty(2, 3, device="meta")).device.type == "meta"


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_call_of_the_action_gets_the_next_call_of_the_stream(dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Identity())
    x = torch.zeros(4, 6, dtype=dtype)
    with surgery.apply(model, {"n": {"kind": "modify_output", "select": "0", "op": "noise", "std": 0.5}}, seed=7):
        got = [model(x) for _ in range(3)]
    key = seed_for(7, "n")
    assert all(torch.equal(g, x + reference(key, c, (4, 6), dtype, 0.5)) for c, g in enumerate(got))


def test_noise_stream_defaults_std_one_and_no_replay() -> None:
    """Without ``replay`` a recomputed call draws anew (the documented modify_grad behaviour), std defaults to 1."""
    draw = noise_stream(99)
    x = torch.zeros(3, 4, requires_grad=True)
    y = checkpoint(lambda t: (t + draw(t)) ** 2, x, use_reentrant=False)
    assert torch.equal(y.detach(), reference(99, 0, (3, 4), torch.float32) ** 2)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * reference(99, 1, (3, 4), torch.float32))  # the recomputation was call 1
    assert torch.equal(draw(torch.zeros(2)), reference(99, 2, (2,), torch.float32))


def test_the_compiled_arithmetic_on_the_counter_tensor_gives_the_eager_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled code derives the call key from the counter tensor: run that branch eagerly and compare to the rule."""
    draw = noise_stream(2**62 + 12345, std=3.0)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = [draw(torch.zeros(3, 4, dtype=d)) for d in (torch.float32, torch.float64, torch.bfloat16)]
    assert noise_stream(1)(torch.empty(2, device="meta")).device.type == "meta"
    monkeypatch.undo()
    got.append(draw(torch.zeros(5)))  # an eager call continues the same counter
    want = [
        reference(2**62 + 12345, c, s, d, 3.0)
        for c, (s, d) in enumerate(
            [((3, 4), torch.float32), ((3, 4), torch.float64), ((3, 4), torch.bfloat16), ((5,), torch.float32)]
        )
    ]
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))


class Twice(nn.Module):
    """One noised block (``inner``) in two checkpointed regions, then a square so gradients see the noise."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.inner, self.reentrant = nn.Linear(4, 4), reentrant
        with torch.no_grad():
            self.inner.weight.copy_(torch.arange(16.0).view(4, 4) / 10)
            self.inner.bias.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = self.inner(x) if self.reentrant is None else checkpoint(self.inner, x, use_reentrant=self.reentrant)
            x = x * x
        return x.sum()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_block_reused_across_checkpointed_regions_gets_the_gradients_of_a_plain_run(reentrant: bool) -> None:
    action = {"n": {"kind": "modify_output", "select": "inner", "op": "noise", "std": 0.3}}
    grads = []
    for mode in (None, reentrant):
        model = Twice(mode)
        x = torch.ones(2, 4, requires_grad=True)
        with surgery.apply(model, action, seed=1):
            for _ in range(2):  # a second step: the replay memory starts over after a backward
                model(x).backward()
        grads.append((x.grad.clone(), model.inner.weight.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0])
    # reentrant checkpointing accumulates the weight's two contributions in another order (1 ulp apart)
    assert torch.equal(grads[0][1], grads[1][1]) if not reentrant else torch.allclose(grads[0][1], grads[1][1])


def test_a_region_calling_the_module_with_two_shapes_is_refused() -> None:
    model = nn.Sequential(nn.Identity())
    x, z = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    with surgery.apply(model, {"n": {"kind": "modify_output", "select": "0", "op": "noise", "std": 1.0}}):
        out = checkpoint(lambda a, b: model(a * a).sum() + model(b * b).sum(), x, z, use_reentrant=False)
        with pytest.raises(surgery.ActionError) as err:
            out.backward()
    assert str(err.value) == f"actions.n on module '0': RuntimeError: {REFUSAL}"


def test_a_forward_inside_a_backward_with_no_original_call_is_refused_even_after_inference_mode_calls() -> None:
    """Calls under inference_mode are never recomputed, so they are not remembered for replay."""
    model = nn.Sequential(nn.Identity())
    with surgery.apply(model, {"n": {"kind": "modify_output", "select": "0", "op": "noise", "std": 1.0}}):
        with torch.inference_mode():
            model(torch.zeros(2))
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        y.register_hook(lambda g: g + model(torch.zeros(2)))
        with pytest.raises(surgery.ActionError) as err:
            y.sum().backward()
    assert str(err.value) == f"actions.n on module '0': RuntimeError: {REFUSAL}"


def test_replay_remembers_at_most_the_last_1024_calls_and_halves_when_full() -> None:
    memory, shape = _Replay(), torch.Size([2])
    for counter in range(1025):
        memory.original(0, counter, shape)
    assert [memory.recomputed(0, 7, shape) for _ in range(513)] == list(range(1024, 511, -1))
    with pytest.raises(RuntimeError) as err:
        memory.recomputed(0, 7, shape)
    assert str(err.value) == REFUSAL


def test_replay_forgets_a_backwards_calls_once_a_new_forward_starts() -> None:
    memory, shape = _Replay(), torch.Size([2])
    memory.original(0, 0, shape)
    assert memory.recomputed(0, 5, shape) == 0
    memory.original(0, 1, shape)
    assert memory.recomputed(0, 6, shape) == 1
    with pytest.raises(RuntimeError, match="matches no call of the forward pass"):
        memory.recomputed(0, 6, shape)  # call 0 belonged to the previous backward
