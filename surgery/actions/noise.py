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


def noise_stream(key: int, std: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """``draw(t)``: normals (mean 0, ``std``) shaped like ``t``, new on every call, starting from ``key``.

    The call counter is a tensor so compiled code does not recompile as it grows; eager
    code derives the per-call key in Python (fewer small tensor ops), compiled code with
    the same arithmetic on the counter tensor, so both give the same bits.
    """
    key = _signed(key)
    with torch.inference_mode(False):  # a stream built under inference_mode must still count outside it
        calls = torch.zeros((), dtype=torch.int64)

    def draw(t: torch.Tensor) -> torch.Tensor:
        call_key: int | torch.Tensor
        if torch.compiler.is_compiling():
            call_key = mix_(calls * GAMMA + key).to(t.device)
        else:
            call_key = mix_int(int(calls) * _GAMMA + key)
        calls.add_(1)
        return normals(t.shape, t.dtype, t.device, call_key, std)

    return draw
