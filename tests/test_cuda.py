"""On a CUDA device: every kind's contract, studies, generation and captures, against plain PyTorch on the same GPU.

Marked ``cuda``: skipped with a reason where torch sees no GPU; ``scripts/gpu_check`` runs them. Each
surgered result is compared bit for bit with the same hooks written by hand and run on the same device
and dtype (the same kernels, so the same bits); hooks on the hot path run under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any host-device synchronisation.
"""

from __future__ import annotations

import copy
import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import surgery
from surgery.files.write import host_copies, write_tensors
from tests.conftest import Snapshot
from tests.test_contract import CASE_NAMES, EFFECTS, MODELS, assert_runs_equal, config, prepared, run

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SYNCING = {"log": "prints each call's statistics (mean, std, min, max), which reads them on the host"}
TABLE = [(n, c, d) for n in MODELS for c in CASE_NAMES for d in DTYPES]


def on_gpu(model_name: str, case: str, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    """The contract table's seeded model and input, moved to the GPU in ``dtype``."""
    model, x = prepared(model_name, case)
    return model.to(CUDA, dtype), x.to(CUDA, dtype)


@contextmanager
def no_sync() -> Iterator[None]:
    """Any host-device synchronisation inside raises (CUDA's sync debug mode), restored on exit."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def forward_backward(model: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward of the output's sum, nothing read back to the host."""
    x = x.detach().clone().requires_grad_(True)
    model(x).sum().backward()


@pytest.mark.parametrize(("model_name", "case", "dtype"), TABLE, ids=[f"{n}-{c}-{str(d)[6:]}" for n, c, d in TABLE])
def test_contract_on_cuda(model_name: str, case: str, dtype: torch.dtype, capsys: pytest.CaptureFixture[str]) -> None:
    """Each kind on each model and dtype: its effect equals plain PyTorch on the GPU, and remove() restores."""
    model, x = on_gpu(model_name, case, dtype)
    m = MODELS[model_name]
    before = Snapshot.of(model)
    reference = run(model, x)
    ref = copy.deepcopy(model)
    with surgery.apply(model, {"act": config(case, m)}, verify=True) as s:
        EFFECTS[case](model, ref, x, m, s, capsys)
    before.assert_same(model)
    assert_runs_equal(run(model, x), reference)


@pytest.mark.parametrize("case", [c for c in CASE_NAMES if c.split("/")[0] not in SYNCING])
def test_hooks_never_synchronise_with_the_host(case: str) -> None:
    """Forward and backward through every kind's hooks raise nothing under sync debug mode "error"."""
    model, x = on_gpu("transformer", case, torch.float32)
    forward_backward(model, x)  # warm-up: kernels loaded, allocator primed
    with no_sync():
        forward_backward(model, x)  # the bare model itself must not synchronise, or this test proves nothing
    with surgery.apply(model, {"act": config(case, MODELS["transformer"])}) as s:
        forward_backward(model, x)
        with no_sync():
            for _ in range(2):
                forward_backward(model, x)
        assert s is not None


def test_a_source_pass_and_patch_never_synchronise() -> None:
    """Patching from a source pass (the study's core) stays on the device too."""
    model, x = on_gpu("transformer", "capture", torch.float32)
    recipe = {
        "cap": {"kind": "capture", "select": "block.mlp"},
        "patch": {"kind": "modify_output", "select": "block.mlp", "op": "set", "index": "[:, -1]",
                  "from": {"capture": "cap"}},
    }  # fmt: skip
    with surgery.apply(model, recipe) as s:
        with s.source_pass():
            model(x)
        model(x + 1)
        with no_sync():
            with s.source_pass():
                model(x)
            model(x + 1)


def test_to_disk_captures_go_through_pinned_memory_and_equal_hand_hooks(tmp_path: Path) -> None:
    """``to: disk`` shards from a GPU run: pinned host copies, one wait, the same bytes as a hand hook's .cpu()."""
    model, x = on_gpu("transformer", "capture", torch.float32)
    seen: dict[str, torch.Tensor] = {}
    names = ["block.attn", "block.mlp", "head"]
    handles = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, o)) for n in names]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    with surgery.apply(model, {"c": {"kind": "capture", "select": names, "to": "disk"}}) as s:
        with torch.no_grad(), no_sync():
            model(x)
        flat = s.take_streamed()
    assert all(t.is_cuda for t in flat.values())
    host = host_copies(flat)
    assert all(t.is_pinned() and t.device.type == "cpu" for t in host.values())
    for name in names:
        assert torch.equal(host[f"c/{name}/output"], seen[name].cpu())
    write_tensors(tmp_path / "shard.safetensors", flat)
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "shard.safetensors"))
    assert all(torch.equal(back[k], host[k]) for k in host)


def test_no_gpu_memory_grows_across_100_apply_remove_cycles() -> None:
    """Hooks, records and added tensors are all released by remove(): allocated memory returns to its level."""
    model, x = on_gpu("transformer", "capture", torch.float32)
    recipe = {
        "cap": {"kind": "capture", "select": "block.*"},
        "add": {"kind": "add_parameter", "select": "block.mlp.fc", "name": "extra", "like": "weight",
                "init": {"method": "ones"}},
        "mul": {"kind": "modify_output", "select": "block.mlp", "op": "mul", "value": 0.5},
        "grad": {"kind": "capture_grad", "select": "block.mlp.fc"},
    }  # fmt: skip

    def cycle() -> None:
        with surgery.apply(model, recipe):
            forward_backward(model, x)
        model.zero_grad(set_to_none=True)

    cycle()
    gc.collect()
    torch.cuda.synchronize()
    level = torch.cuda.memory_allocated()
    for _ in range(100):
        cycle()
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == level


def test_a_study_on_cuda_equals_the_hand_loop_bit_for_bit(tiny_lm) -> None:
    """A layer × position patching grid on the GPU, against the same hooks by hand on the GPU."""
    from tests.test_study import METRICS, PATCH, hand_patching

    model, clean, corrupt = tiny_lm
    model, clean, corrupt = copy.deepcopy(model).to(CUDA), clean.to(CUDA), corrupt.to(CUDA)
    result = surgery.study(model, PATCH, {"layer": "0:2", "pos": "all"}, corrupt, METRICS, source=clean, batch_cells=1)
    assert torch.equal(result.values["logit_diff"].cpu(), hand_patching(model, clean, corrupt).cpu())
    batched = surgery.study(model, PATCH, {"layer": "0:2", "pos": "all"}, corrupt, METRICS, source=clean)
    assert torch.allclose(batched.values["logit_diff"].cpu(), result.values["logit_diff"].cpu(), atol=1e-4)


def test_attribution_on_cuda_matches_the_cpu(tiny_lm) -> None:
    """One backward pass per batch on the GPU gives the CPU's attribution scores (float32 tolerance)."""
    from tests.test_study import METRICS, PATCH

    model, clean, corrupt = tiny_lm
    grid = {"layer": "0:2", "pos": "all"}
    cpu = surgery.study(model, PATCH, grid, corrupt, METRICS[:1], source=clean, method="attribution")
    gpu_model = copy.deepcopy(model).to(CUDA)
    gpu = surgery.study(gpu_model, PATCH, grid, corrupt.to(CUDA), METRICS[:1], source=clean.to(CUDA),
                        method="attribution")  # fmt: skip
    assert torch.allclose(gpu.values["logit_diff"].cpu(), cpu.values["logit_diff"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_generation_on_cuda_equals_generate_with_the_hook_by_hand(dtype: torch.dtype) -> None:
    """Greedy generation under a surgery on the GPU (float32, bfloat16, float16) equals model.generate + hand hook."""
    from surgery.lm.generate import generate_both
    from surgery.lm.text import encode_prompts
    from tests.lm_helpers import hand_generate, tiny_gpt2, trimmed, word_tokenizer
    from tests.test_lm import PROMPTS, SENTENCES, ZERO_MLP

    tok = word_tokenizer(SENTENCES)
    torch.manual_seed(0)
    model = tiny_gpt2(len(tok), tok.eos_token_id, initializer_range=1.0).to(CUDA, dtype)
    batch = encode_prompts(tok, prompts=PROMPTS).to(CUDA)
    out = generate_both(model, ZERO_MLP, batch, max_new_tokens=6, tokenizer=tok)
    start, eos = batch.input_ids.shape[1], tok.eos_token_id
    after = trimmed(hand_generate(model, batch, tok, 6, lambda m, i, o: torch.zeros_like(o)), start, eos)
    before = trimmed(hand_generate(model, batch, tok, 6), start, eos)
    assert [list(r) for r in out.surgered] == after and [list(r) for r in out.unmodified] == before
    assert surgery.core.restore.hooks_on(model) == 0


def cli_json(tmp_path: Path, *args: str) -> dict[str, Any]:
    """``python -m surgery ARGS`` in ``tmp_path``: exit 0 asserted, its report.json returned."""
    from tests.test_cli import cli, only_run_dir

    tmp_path.mkdir(parents=True, exist_ok=True)
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((only_run_dir(tmp_path) / "report.json").read_text())


def test_the_main_job_on_cuda_scores_as_on_the_cpu(tmp_path: Path) -> None:
    """``+model=cnn +actions=linearize device=cuda``: the digits accuracy before and after, as on the CPU."""
    gpu = cli_json(tmp_path / "gpu", "+model=cnn", "+actions=linearize", "device=cuda")
    cpu = cli_json(tmp_path / "cpu", "+model=cnn", "+actions=linearize", "device=cpu")
    for side in ("unmodified", "surgered"):
        assert abs(gpu["metrics"][side]["accuracy"] - cpu["metrics"][side]["accuracy"]) <= 0.002


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_cli_runs_capture_to_disk_on_cuda(tmp_path: Path, dtype: str) -> None:
    """A bfloat16/float16 GPU run writes its ``to: disk`` shards in that dtype, equal to a hand hook's output."""
    from safetensors.torch import load_file

    from tests.exact_runs import job_of, outputs_of

    names = ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    args = ("+model=gpt2_tiny", f"+actions={{c: {{kind: capture, select: [{','.join(names)}], to: disk}}}}",
            f"dtype={dtype}", "device=cuda")  # fmt: skip
    report = cli_json(tmp_path, *args)
    run_dir = Path(next(iter(tmp_path.glob("outputs/*/*/report.json")))).parent
    shard = load_file(str(run_dir / "captures" / "batch-00000.safetensors"))
    model, inputs = job_of(*args)
    for name, out in outputs_of(model, names, inputs).items():
        got = shard[f"c/{name}/output"]
        assert got.dtype == getattr(torch, dtype) and torch.equal(got, out.cpu())
    assert report["captures"]["shards"]
