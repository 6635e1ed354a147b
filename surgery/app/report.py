"""What a run reports: tensor stats, differences, sha256 fingerprints, flattened captures."""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

import torch


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard (report.json: ranks)
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def fingerprint(value: Any) -> str:
    """sha256 over tensors (name, dtype, shape, bytes) in a dict/tuple/tensor, or over JSON."""
    h = hashlib.sha256()

    def feed(v: Any, prefix: str) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"{prefix}|{v.dtype}|{tuple(v.shape)}|".encode())
            h.update(_tensor_bytes(v))
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                feed(v[k], f"{prefix}/{k}")
        elif isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
            for i, x in enumerate(v):
                feed(x, f"{prefix}/{i}")
        else:
            h.update(json.dumps(v, sort_keys=True, default=str).encode())

    feed(value, "")
    return h.hexdigest()


def stats(t: Any) -> dict[str, Any]:
    """Shape, dtype and (for float tensors) mean/std/min/max/abs-max of a tensor."""
    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__}
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if t.is_floating_point() and t.numel():
        v = t.detach().double()
        out.update(
            mean=v.mean().item(),
            std=v.std().item() if v.numel() > 1 else 0.0,
            min=v.min().item(),
            max=v.max().item(),
        )
    return out


def difference(new: Any, old: Any) -> dict[str, Any]:
    """max abs, mean abs, MSE (and KL of softmaxes for 2-D logits) between two outputs."""
    if not (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)):
        return {"comparable": False, "reason": "outputs are not both tensors"}
    if new.shape != old.shape:
        return {"comparable": False, "reason": f"shapes differ: {list(new.shape)} vs {list(old.shape)}"}
    a, b = new.detach().double(), old.detach().double()
    d = a - b
    out: dict[str, Any] = {
        "comparable": True,
        "max_abs": d.abs().max().item() if d.numel() else 0.0,
        "mean_abs": d.abs().mean().item() if d.numel() else 0.0,
        "mse": (d * d).mean().item() if d.numel() else 0.0,
        "equal": bool(torch.equal(new, old)),
    }
    if a.dim() == 2 and a.shape[-1] > 1:
        log_p, log_q = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
        out["kl"] = torch.sum(log_p.exp() * (log_p - log_q), -1).mean().item()  # KL(original || surgered)
    return out


def first_tensor(value: Any) -> Any:
    """The tensor a model output stands for: itself, or its first tensor element."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for v in items:
        if isinstance(v, torch.Tensor):
            return v
    return value


def environment(device: str) -> dict[str, str]:
    """Versions of python, torch and surgery, the CPU and its vector capability, and the device used.

    The CPU matters for bits: MKL picks GEMM kernels by CPU (and by alignment), so the same run can
    differ in the last float bits on another machine; ``surgery.replay`` names what changed.
    """
    from surgery import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "surgery": __version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "device": device,
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` knows)."""
    from surgery.errors import ConfigError
    from surgery.files.gate import read_text

    try:
        for line in read_text("/proc/cpuinfo", "report.machine").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except ConfigError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def output_tensors(value: Any, prefix: str = "output") -> dict[str, torch.Tensor]:
    """The tensors of a model output by path (``output``, ``output/0``, ``output/logits``), for output.safetensors."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (tuple, list)) else ()
    found: dict[str, torch.Tensor] = {}
    for key, item in items:
        found.update(output_tensors(item, f"{prefix}/{key}"))
    return found


def every_match(plan: list[dict[str, Any]]) -> str:
    """Every matched module (or tensor) name of each action, one action per block: what the plan table cuts short."""
    blocks = []
    for step in plan:
        names = step.get("tensors") or step.get("matched") or []
        blocks.append(f"{step['action']} ({len(names)}):" + "".join(f"\n  {name}" for name in names))
    return "\n".join(blocks)
