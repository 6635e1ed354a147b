"""Tensors read from files, made to behave bit-for-bit like tensors made in memory.

A tensor read from ``.safetensors`` (or wrapped from numpy) can start at any byte offset;
on some CPUs (AMD EPYC, AVX2, MKL) a GEMM on such a tensor takes another code path and the
result differs in the last bits from the same numbers in fresh memory. Every reader copies
what it returns with ``owned`` so results do not depend on where a file put the bytes.
"""

from __future__ import annotations

import weakref

import torch

ALIGNMENT = 64  # bytes; what PyTorch's CPU allocator guarantees for fresh storage


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` in fresh storage of its own, ``ALIGNMENT``-byte aligned.

    Example: ``weights = {k: owned(v) for k, v in load_file(path).items()}``.
    """
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    copy.copy_(tensor.detach())
    if copy.numel() and copy.data_ptr() % ALIGNMENT:  # an allocator that does not align: never silently
        raise RuntimeError(f"the allocator returned memory aligned to less than {ALIGNMENT} bytes")
    return copy


def is_owned(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is contiguous, starts its own storage, fills all of it and is aligned."""
    storage = tensor.untyped_storage()
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and storage.nbytes() == tensor.numel() * tensor.element_size()
        and tensor.data_ptr() % ALIGNMENT == 0
    )


_COMPUTED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def computed(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as computed by surgery itself from a run's config (a steering vector from prompts), so
    ``safe=true``, which refuses tensors handed in from Python, takes it as an action's ``value``."""
    _COMPUTED[id(tensor)] = tensor
    return tensor


def is_computed(tensor: torch.Tensor) -> bool:
    """Whether ``computed`` marked this very tensor (not an equal one)."""
    return _COMPUTED.get(id(tensor)) is tensor


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with no two sharing memory (a later one that shares is cloned): what ``save_file`` accepts.

    GPT-2's blocks all receive the same ``position_ids`` tensor, so a capture of block inputs holds one
    tensor under several keys; safetensors refuses to write shared memory.
    """
    seen: set[int] = set()
    out = {}
    for key, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else -1
        out[key] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    return out
