"""``torchrun --nproc_per_node=2 -m surgery ... mode=harvest``: two ranks share the shards, one manifest covers all.

One torchrun launch (gloo, CPU); the rows of every shard together are the packed corpus exactly once, and
each row's activations are the model's own (the same forward hooks in plain PyTorch, 4 rows a batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import surgery.activations
from tests.harvest_helpers import make_corpus, outputs_by_hand, packed_by_hand

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")

ROOT = Path(__file__).resolve().parent.parent
SITES = ["transformer.h.0", "transformer.h.1"]


def test_two_ranks_cover_the_corpus_once(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path, datasets=False)
    out = tmp_path / "run"
    shard_mb = 8 * 16 * 32 * 4 / 2**20  # 8 rows a shard: 10 shards, 5 a rank
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "surgery",
        "+model=hf", f"model.path={corpus.lm}", "+input=text_dataset", f"input.path={corpus.jsonl}",
        "input.context=16", "input.batch_size=4", "mode=harvest", f"harvest.sites=[{','.join(SITES)}]",
        f"harvest.shard_mb={shard_mb}", f"hydra.run.dir={out}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    rows = surgery.activations.open(out / "activations", by="row")
    manifest = rows.manifest
    assert manifest["complete"] and manifest["world_size"] == 2 and len(manifest["shards"]) == 10
    assert report["computed"] == 5  # rank 0's share: shards 0, 2, 4, 6, 8
    assert not any(out.glob(".rank*")) and not list(out.rglob(".*.tmp"))
    ids = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
    assert torch.equal(ids, packed_by_hand(corpus.tokenizer, corpus.documents, 16))  # every row once, in order
    expected = outputs_by_hand(corpus.model, ids, SITES, batch=4)
    for site in SITES:
        got = torch.stack([rows[i][site] for i in range(len(rows))])
        torch.testing.assert_close(got, expected[site], rtol=0, atol=1e-6)
