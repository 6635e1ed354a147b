"""Parameter-level kinds on sharded and data-parallel models (SPEC §10), on 2 gloo ranks through torchrun.

One torchrun launch for the whole module (tests/sharded_worker.py runs every scenario on both ranks and
writes what it found to JSON); each test asserts on one scenario, for every rank. The references are
plain PyTorch: the unsharded model with the same seed, the same FSDP2 model without surgery, and the
gradient autograd computes on the unsharded model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")

WORKER = Path(__file__).with_name("sharded_worker.py")


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every scenario's findings, one dict per rank."""
    out = tmp_path_factory.mktemp("sharded") / "found.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def ranks(found: dict[str, list[dict[str, Any]]], scenario: str) -> list[dict[str, Any]]:
    """The scenario's two findings, failing with the worker's traceback if it raised."""
    both = found[scenario]
    assert len(both) == 2
    for one in both:
        assert "error" not in one, one.get("traceback", one["error"])
    return both


def test_fsdp2_type_matches_the_original_class(found: dict[str, list[dict[str, Any]]]) -> None:
    for rank in ranks(found, "fsdp2_type"):
        assert rank["class"] == "FSDPLinear"
        assert rank["matched"] == ["fc1", "fc2"]


def test_fsdp2_seeded_init_draws_the_whole_tensor_once(found: dict[str, list[dict[str, Any]]]) -> None:
    for rank in ranks(found, "fsdp2_init"):
        assert rank == {"equals_unsharded": True, "shards_repeat": False, "local_rows": 16, "restored": True}


def test_fsdp2_gradient_hooks_act_on_the_gradient_autograd_uses(found: dict[str, list[dict[str, Any]]]) -> None:
    for rank in ranks(found, "fsdp2_grads"):
        assert rank["doubled"] and rank["changed"]  # modify_grad mul 2: the reduced gradient is twice the plain one
        assert rank["captured_is_local_grad"] and rank["captured_shape"] == [32, 8]  # whole, before reduce-scatter
        assert rank["after_remove"]


def test_fsdp2_replace_forward_linear_reads_the_whole_weight(found: dict[str, list[dict[str, Any]]]) -> None:
    for rank in ranks(found, "fsdp2_linear"):
        assert rank == {"same_output": True, "grad_made": True}


def test_fsdp1_per_parameter_kinds_are_refused_at_plan_time(found: dict[str, list[dict[str, Any]]]) -> None:
    for rank in ranks(found, "fsdp1_orig"):
        for key in ("init", "modify_grad", "capture_grad"):
            assert rank[key].startswith("ConfigError: actions.")
            assert "cannot be honoured under FSDP1" in rank[key] and "fully_shard" in rank[key]
        assert rank["module_hook_matched"] == ["fc1"]


def test_fsdp1_flat_parameters_are_named_in_the_no_match_error(found: dict[str, list[dict[str, Any]]]) -> None:
    for rank in ranks(found, "fsdp1_flat"):
        assert rank["capture_grad"].startswith("NoMatchError: actions.c.param: 'weight' matched no parameter")
        assert "use_orig_params=False" in rank["capture_grad"]


def test_ddp_changes_to_the_parameter_set_warn_at_plan_time(found: dict[str, list[dict[str, Any]]]) -> None:
    for rank in ranks(found, "ddp"):
        assert rank["bare_warnings"] == []
        warned = {w.split(" ", 1)[0]: w for w in rank["warnings"]}
        assert sorted(warned) == ["actions.a", "actions.f", "actions.r"]
        assert all("apply it before wrapping in DistributedDataParallel" in w for w in warned.values())
        assert "find_unused_parameters=True" in warned["actions.f"]
