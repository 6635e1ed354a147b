"""Seeded Gaussian noise from a counter-based hash in plain tensor ops (no ``torch.Generator``).

Element ``i`` of call ``c`` is a function of ``(key, c, i)`` only: splitmix64 mixes the
key and the call number into a per-call key, and again that key plus ``i`` times the
golden-ratio step into 64 random bits; Box–Muller turns two uniforms into two normals.
The integer part is exact on every device, so the numbers are the same everywhere up to
float rounding; and since there is no generator object or Python-side state to
specialise on, Dynamo traces it whole and compiled runs equal eager ones. The call
counter is a 0-d int64 tensor updated in place, so compiled code reads it as an input
instead of recompiling on each new value.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2**64 / golden ratio, odd)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_SHIFTS = (30, 27, 31)


def _signed(value: int) -> int:
    """``value`` mod 2**64 as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


GAMMA, MUL1, MUL2 = _signed(_GAMMA), _signed(_MUL1), _signed(_MUL2)


def mix_int(z: int) -> int:
    """splitmix64's finaliser on a Python int, returned as a signed int64 value."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return _signed(z ^ (z >> 31))


def mix_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor, in place (masks make the right shifts logical)."""
    for shift, mul in zip(_SHIFTS, (MUL1, MUL2, None)):
        z.bitwise_xor_((z >> shift).bitwise_and_((1 << (64 - shift)) - 1))
        if mul is not None:
            z.mul_(mul)  # int64 multiplication wraps: the low 64 bits of the unsigned product
    return z


def normals(
    shape: torch.Size, dtype: torch.dtype, device: torch.device, key: int | torch.Tensor, std: float = 1.0
) -> torch.Tensor:
    """Normals (mean 0, ``std``) of ``shape`` from the stream ``key`` (an int or a 0-d int64 tensor).

    float64 draws two 53-bit uniforms per pair of normals (two hashes); every other dtype is
    computed in float32 from two 24-bit uniforms of one hash, then cast.
    """
    n = math.prod(shape)
    pairs = (n + 1) // 2
    wide = dtype == torch.float64
    work = torch.float64 if wide else torch.float32
    bits = 53 if wide else 24
    z = torch.arange(2 * pairs if wide else pairs, dtype=torch.int64, device=device).mul_(GAMMA).add_(key)
    mix_(z)
    if wide:
        radius_bits, angle_bits = z[:pairs] >> 11, z[pairs:] >> 11  # top 53 bits, signed
    else:
        radius_bits, angle_bits = z >> 40, z.bitwise_and_((1 << 24) - 1)  # top and bottom 24 bits
    # radius: u in (0, 1], so log(u) is finite; the shift left the bits signed in [-2**(bits-1), 2**(bits-1))
    u = radius_bits.to(work).add_(2.0 ** (bits - 1) + 1).mul_(2.0**-bits)
    radius = u.log_().mul_(-2.0 * std * std).sqrt_()  # std folded in: one op fewer per call
    angle = angle_bits.to(work).mul_(2 * math.pi * 2.0**-bits)  # wide: in [-pi, pi), else [0, 2*pi)
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([cos.mul_(radius), sin.mul_(radius)])[:n].view(shape).to(dtype)


REPLAY_LIMIT = 1024  # calls of one module remembered for recomputation (older ones are forgotten)


def _may_be_recomputed() -> bool:
    """Whether activation checkpointing could rerun this forward call: inside a non-reentrant region (saved-tensor
    hooks are set) or a reentrant one (its forward runs under no_grad). Plain training forwards are not kept."""
    if torch.is_inference_mode_enabled():
        return False
    return not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


class _Replay:
    """The counter values of calls a checkpointed region may recompute, per module, since the last backward.

    ``torch.utils.checkpoint`` (reentrant or not) reruns a region's forward during the backward pass,
    with torch's RNG state restored but not ours, so a recomputed call must reuse its original counter.
    A forward hook running inside a backward pass (a graph task is current) is such a recomputation.
    Regions are recomputed in reverse order of their forward, so the k-th recomputation of a module in
    one backward takes the k-th last original call of that module: exact whenever each checkpointed
    region calls a module at most once (a block reused across regions is fine, twice within one is not).
    """

    def __init__(self) -> None:
        self.calls: dict[int, list[tuple[int, torch.Size]]] = {}  # module -> (counter, shape) of original calls
        self.task = -1  # the backward whose recomputations ``taken`` counts
        self.taken: dict[int, int] = {}
        self.stale = False  # a backward ran since the last original call: its calls are no longer needed

    def original(self, slot: int, counter: int, shape: torch.Size) -> None:
        """Remember an ordinary call."""
        if self.stale:
            self.calls.clear()
            self.stale = False
        calls = self.calls.setdefault(slot, [])
        if len(calls) >= REPLAY_LIMIT:
            del calls[: REPLAY_LIMIT // 2]  # a no_grad loop never backpropagates: keep the memory bounded
        calls.append((counter, shape))

    def recomputed(self, slot: int, task: int, shape: torch.Size) -> int:
        """The counter the original of this recomputed call used."""
        if task != self.task:
            self.task, self.taken = task, {}
        self.stale = True
        k = self.taken[slot] = self.taken.get(slot, 0) + 1
        calls = self.calls.get(slot, [])
        if k > len(calls) or calls[-k][1] != shape:
            raise RuntimeError(
                "noise: a forward ran inside the backward pass (activation checkpointing recomputing a region) that"
                " matches no call of the forward pass, so it cannot get the same noise; checkpoint regions that call"
                " a noised module at most once each"
            )
        return calls[-k][0]


def noise_stream(key: int, std: float = 1.0, replay: bool = False) -> Callable[..., torch.Tensor]:
    """``draw(t, slot)``: normals (mean 0, ``std``) shaped like ``t``, new on every call, starting from ``key``.

    The call counter is a tensor so compiled code does not recompile as it grows; eager
    code derives the per-call key in Python (fewer small tensor ops), compiled code with
    the same arithmetic on the counter tensor, so both give the same bits. With ``replay``
    (forward hooks), a call recomputed by activation checkpointing during the backward pass
    gets the noise of its original call (``slot`` says which module is calling; see ``_Replay``).
    """
    key = _signed(key)
    with torch.inference_mode(False):  # a stream built under inference_mode must still count outside it
        calls = torch.zeros((), dtype=torch.int64)
    memory = _Replay() if replay else None

    def draw(t: torch.Tensor, slot: int = 0) -> torch.Tensor:
        call_key: int | torch.Tensor
        if torch.compiler.is_compiling():
            call_key = mix_(calls * GAMMA + key).to(t.device)
            calls.add_(1)
            return normals(t.shape, t.dtype, t.device, call_key, std)
        task = torch._C._current_graph_task_id() if memory is not None else -1
        if memory is not None and task != -1:
            counter = memory.recomputed(slot, task, t.shape)
        else:
            counter = int(calls)
            calls.add_(1)
            if memory is not None and _may_be_recomputed():
                memory.original(slot, counter, t.shape)
        call_key = mix_int(counter * _GAMMA + key)
        return normals(t.shape, t.dtype, t.device, call_key, std)

    return draw
