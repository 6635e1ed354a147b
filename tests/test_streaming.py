"""Many batches: streaming captures to disk, running statistics, and refusing oversized captures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import surgery
from surgery.app.job import run_job
from surgery.errors import ConfigError
from tests.exact_runs import outputs_of, prepared
from tests.test_cli import REPO, composed


def test_disk_capture_writes_one_shard_per_batch_with_every_batchs_tensors(tmp_path: Path) -> None:
    cfg = composed("+model=mlp", "+actions=capture", "+actions.capture.to=disk", "+input.batches=3")
    report = run_job(cfg, tmp_path)
    assert report["captures"]["shards"] == [f"batch-0000{i}.safetensors" for i in range(3)]
    assert report["captures"]["file"] is None  # nothing kept in memory
    shards = [load_file(str(tmp_path / "captures" / name)) for name in report["captures"]["shards"]]
    names = [f"layers.{i}.fc" for i in range(3)] + ["head"]
    assert set(shards[0]) == {f"capture/{name}/output" for name in names}
    job = prepared("+model=mlp", "+input.batches=3")  # each batch's tensors, by hand-written hooks
    inputs = [batch.args for batch in job.data]
    for batch, shard in enumerate(shards):
        want = outputs_of(job.model, names, inputs[batch])
        assert all(torch.equal(shard[f"capture/{name}/output"], want[name]) for name in names), batch
    # batch 0 is the run's own input; later batches are different inputs
    assert not torch.equal(shards[0]["capture/head/output"], shards[1]["capture/head/output"])
    assert report["batches"] == 3


def test_batches_are_reproducible_and_batch_zero_is_the_one_batch_run(tmp_path: Path) -> None:
    one = run_job(composed("+model=mlp", "+actions=linearize"), tmp_path / "a")
    three = run_job(composed("+model=mlp", "+actions=linearize", "+input.batches=3"), tmp_path / "b")
    again = run_job(composed("+model=mlp", "+actions=linearize", "+input.batches=3"), tmp_path / "c")
    assert three["fingerprints"] == again["fingerprints"]
    assert three["fingerprints"]["input"] == one["fingerprints"]["input"]
    assert three["output"] == one["output"]  # stats reported for batch 0


def test_reduce_stats_matches_the_statistics_of_every_call() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    with surgery.apply(model, {"s": {"kind": "capture", "select": "0", "reduce": "stats"}}) as s:
        outs = torch.cat([model(x).detach() for x in xs])
    record = s.captures["s"]["0"]
    assert record.calls == []  # nothing kept per call
    got = record.reduced["output"]
    assert got["count"].item() == 20
    torch.testing.assert_close(got["mean"], outs.mean(0))
    torch.testing.assert_close(got["std"], outs.std(0))
    assert torch.equal(got["min"], outs.amin(0)) and torch.equal(got["max"], outs.amax(0))
    with surgery.apply(model, {"m": {"kind": "capture", "select": "0", "reduce": "mean"}}) as s:
        model(xs[0])
    assert set(s.captures["m"]["0"].reduced["output"]) == {"mean", "count"}


def test_reduce_keys_in_the_captures_file(tmp_path: Path) -> None:
    cfg = composed("+model=mlp", "+actions=capture", "+actions.capture.reduce=stats", "+input.batches=4")
    run_job(cfg, tmp_path)
    flat = load_file(str(tmp_path / "captures.safetensors"))
    assert flat["capture/head/output/count"].item() == 16  # 4 batches of 4
    assert {"capture/head/output/mean", "capture/head/output/std", "capture/head/output/min"} <= set(flat)


def test_max_bytes_refuses_before_running(tmp_path: Path) -> None:
    # the MLP's head output is 4 x 4 float32 = 64 bytes a batch; three fc outputs 4 x 32 x 4 = 512 each
    per_batch = 64 + 3 * 512
    ok = composed("+model=mlp", "+actions=capture", f"+actions.capture.max_bytes={per_batch * 10}", "+input.batches=10")
    run_job(ok, tmp_path / "ok")
    too_big = composed(
        "+model=mlp", "+actions=capture", f"+actions.capture.max_bytes={per_batch * 10 - 1}", "+input.batches=10"
    )
    with pytest.raises(
        ConfigError, match=r"actions\.capture\.max_bytes: the capture would hold about 15\.6 KiB over 10 batch"
    ):
        run_job(too_big, tmp_path / "no")
    assert not (tmp_path / "no" / "report.json").exists()
    disk = composed(
        "+model=mlp",
        "+actions=capture",
        "+actions.capture.to=disk",
        f"+actions.capture.max_bytes={per_batch}",
        "+input.batches=10",
    )
    run_job(disk, tmp_path / "disk")  # on disk only one batch is held at a time


def test_disk_and_reduce_do_not_combine() -> None:
    with pytest.raises(ConfigError, match="actions.c.to: reduce keeps running statistics in memory"):
        surgery.plan(nn.Linear(2, 2), {"c": {"kind": "capture", "to": "disk", "reduce": "mean"}})


def _peak_rss_mib(*overrides: str, cwd: Path) -> float:
    """Peak RSS of one CLI run, in MiB (a fresh child process, so ru_maxrss is its own)."""
    script = (
        "import resource, runpy, sys; sys.argv = ['surgery', *sys.argv[1:]];\n"
        "try:\n    runpy.run_module('surgery', run_name='__main__')\nfinally:\n"
        "    print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", script, *overrides], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    peak = [line for line in result.stderr.splitlines() if line.startswith("PEAK")][-1]
    return int(peak.split()[1]) / 1024


def test_a_200_batch_disk_capture_stays_within_about_one_batch_of_memory(tmp_path: Path) -> None:
    # every conv/linear output of 32 images is ~1.4 MiB a batch: 200 batches would be ~280 MiB in memory
    common = [
        "+model=cnn",
        "+input=random",
        "+actions=capture",
        "+actions.capture.to=disk",
        "model.input.shape=[32,1,28,28]",
        "compare=false",
    ]
    one = _peak_rss_mib(*common, "+input.batches=1", "hydra.run.dir=one", cwd=tmp_path)
    many = _peak_rss_mib(*common, "+input.batches=200", "hydra.run.dir=many", cwd=tmp_path)
    report = json.loads((tmp_path / "many" / "report.json").read_text())
    assert len(report["captures"]["shards"]) == 200
    shard_mib = (tmp_path / "many" / "captures" / "batch-00000.safetensors").stat().st_size / 2**20
    assert shard_mib > 1  # the capture is real
    assert many - one < 4 * shard_mib + 20, (one, many, shard_mib)  # far below 200 batches' worth
