"""mode=harvest and surgery.activations (SPEC §17): a text corpus in, sharded activations out, read back.

The harvested activations are compared with the same forward hooks in plain PyTorch on the same batches
(bit for bit: the same computation); resume, refusals, Ctrl-C, the CLI and its bad inputs are checked here,
two torchrun ranks in tests/test_harvest_dist.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import surgery.activations
from surgery.core.limits import Limits, enforced
from surgery.errors import ConfigError
from surgery.harvest import harvest_corpus
from surgery.harvest.config import TextDatasetInput
from surgery.harvest.corpus import TextCorpus, packed_rows
from tests.harvest_helpers import Corpus, make_corpus, outputs_by_hand, packed_by_hand, write_jsonl

REPO = Path(__file__).resolve().parent.parent
SITES = ["transformer.h.0", "transformer.h.1"]
CONTEXT = 16
SHARD_MB = 8 * CONTEXT * 32 * 4 / 2**20  # 8 rows of 16 tokens × 32 float32s: 2 batches of 4 a shard


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def run(corpus: Corpus, out: Path, **options: Any) -> Any:
    """A harvest of the .jsonl corpus: 4 rows a batch, shards of 8 rows (about 4 KiB a site)."""
    defaults: dict[str, Any] = dict(context=CONTEXT, batch_size=4, shard_mb=SHARD_MB, progress=False)
    return harvest_corpus(corpus.model, corpus.tokenizer, corpus.jsonl, out, SITES, **{**defaults, **options})


@pytest.fixture(scope="module")
def harvested(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("harvest") / "activations"
    run(corpus, out)
    return out


# ---------------------------------------------------------------- the corpus


def test_every_corpus_format_packs_the_same_rows(corpus: Corpus) -> None:
    expected = packed_by_hand(corpus.tokenizer, corpus.documents, CONTEXT)
    for path in (corpus.jsonl, corpus.txt, corpus.datasets):
        opened = TextCorpus.open(TextDatasetInput(path=str(path), context=CONTEXT))
        rows = torch.stack(list(packed_rows(corpus.tokenizer, opened.documents(), CONTEXT)))
        assert torch.equal(rows, expected), path


def test_limit_tokens_takes_whole_rows(corpus: Corpus) -> None:
    opened = TextCorpus.open(TextDatasetInput(path=str(corpus.jsonl), context=CONTEXT))
    rows = list(packed_rows(corpus.tokenizer, opened.documents(), CONTEXT, limit_tokens=5 * CONTEXT + 3))
    assert len(rows) == 5


# ---------------------------------------------------------------- harvested = the model's own activations


def test_harvested_rows_equal_the_models_own_outputs_bit_for_bit(corpus: Corpus, harvested: Path) -> None:
    rows = surgery.activations.open(harvested, by="row")
    ids = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
    assert torch.equal(ids, packed_by_hand(corpus.tokenizer, corpus.documents, CONTEXT))
    expected = outputs_by_hand(corpus.model, ids, SITES, batch=4)
    for site in SITES:
        got = torch.stack([rows[i][site] for i in range(len(rows))])
        assert torch.equal(got, expected[site]), site
    manifest = rows.manifest
    assert manifest["complete"] and manifest["rows"] == len(rows) and manifest["tokens"] == len(rows) * CONTEXT
    assert manifest["sites"] == {s: {"shape": [32], "module": s} for s in SITES} and manifest["dtype"] == "float32"
    assert len(manifest["shards"]) == -(-len(rows) // 8) and manifest["rows_per_shard"] == 8
    assert set(manifest["fingerprints"]) == {"model", "corpus", "config", "tokens"}
    assert manifest["surgery_version"] == surgery.__version__


def test_the_reader_names_the_files_the_harvest_writes() -> None:
    from surgery.activations import dataset
    from surgery.harvest import shards

    assert (dataset.MANIFEST, dataset.TOKENS) == (shards.MANIFEST, shards.TOKENS)


def test_by_token_gives_every_kept_token_in_order(corpus: Corpus, harvested: Path) -> None:
    rows = surgery.activations.open(harvested, by="row")
    tokens = surgery.activations.open(harvested)
    ids = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
    kept = ids != corpus.tokenizer.eos_token_id  # bos, pad and eos are the one <eos> here
    assert len(tokens) == int(kept.sum()) == tokens.manifest["kept_tokens"] < ids.numel()
    for site in SITES:
        full = torch.stack([rows[i][site] for i in range(len(rows))])
        assert torch.equal(torch.stack([tokens[i][site] for i in range(len(tokens))]), full[kept])
    assert torch.equal(torch.stack([tokens[i]["token"] for i in range(len(tokens))]), ids[kept])
    batch = next(iter(torch.utils.data.DataLoader(tokens, batch_size=len(tokens), shuffle=False)))
    assert torch.equal(batch["token"], ids[kept]) and batch[SITES[1]].shape == (len(tokens), 32)
    seeded = torch.Generator().manual_seed(0)
    shuffled = torch.utils.data.DataLoader(tokens, batch_size=7, shuffle=True, generator=seeded)
    seen = torch.cat([b["token"] for b in shuffled])
    assert sorted(seen.tolist()) == sorted(ids[kept].tolist())


def test_a_steered_model_is_harvested_as_steered(corpus: Corpus, tmp_path: Path) -> None:
    steer = {"steer": {"kind": "modify_output", "select": "transformer.h.0", "op": "add", "value": 0.5}}
    run(corpus, tmp_path / "a", actions=steer, limit_tokens=12 * CONTEXT)
    rows = surgery.activations.open(tmp_path / "a", by="row")
    ids = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
    expected = outputs_by_hand(corpus.model, ids, SITES, batch=4, add=0.5)
    for site in SITES:
        assert torch.equal(torch.stack([rows[i][site] for i in range(len(rows))]), expected[site]), site


def test_sites_of_several_selectors_and_widths_from_one_forward(corpus: Corpus, tmp_path: Path) -> None:
    sites = ["transformer.h.0", "transformer.h.1.mlp.c_fc"]  # widths 32 and 128 (the MLP's hidden layer)
    harvest_corpus(corpus.model, corpus.tokenizer, corpus.jsonl, tmp_path / "a", sites, context=CONTEXT,
                   batch_size=4, limit_tokens=12 * CONTEXT, progress=False)  # fmt: skip
    rows = surgery.activations.open(tmp_path / "a", by="row")
    assert rows.manifest["sites"] == {s: {"shape": [w], "module": s} for s, w in zip(sites, (32, 128), strict=True)}
    ids = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
    expected = outputs_by_hand(corpus.model, ids, sites, batch=4)
    for site in sites:
        assert torch.equal(torch.stack([rows[i][site] for i in range(len(rows))]), expected[site]), site


class TinyLM(torch.nn.Module):
    """A plain PyTorch LM whose forward takes the token ids positionally."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed, self.mix, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def test_a_plain_pytorch_model_taking_token_ids_positionally(corpus: Corpus, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyLM(len(corpus.tokenizer)).eval()
    harvest_corpus(model, corpus.tokenizer, corpus.jsonl, tmp_path / "a", ["mix"], context=CONTEXT, batch_size=4,
                   limit_tokens=8 * CONTEXT, progress=False)  # fmt: skip
    rows = surgery.activations.open(tmp_path / "a", by="row")
    ids = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
    with torch.no_grad():
        expected = torch.cat([model.mix(model.embed(part)) for part in ids.split(4)])
    assert torch.equal(torch.stack([rows[i]["mix"] for i in range(len(rows))]), expected)


def test_float16_storage_is_the_outputs_rounded(corpus: Corpus, tmp_path: Path) -> None:
    run(corpus, tmp_path / "a", dtype="float16", limit_tokens=8 * CONTEXT)
    rows = surgery.activations.open(tmp_path / "a", by="row")
    ids = torch.stack([rows[i]["input_ids"] for i in range(len(rows))])
    expected = outputs_by_hand(corpus.model, ids, SITES, batch=4)
    assert rows[0][SITES[0]].dtype == torch.float16
    assert torch.equal(torch.stack([rows[i][SITES[1]] for i in range(len(rows))]), expected[SITES[1]].half())


def test_prefetching_passes_items_and_errors_through_and_stops_when_left() -> None:
    import threading

    from surgery.harvest.run import prefetched

    def items() -> Any:
        yield 1
        yield 2
        raise ConfigError("input.path: line 3 is not JSON")

    got = []
    with pytest.raises(ConfigError, match="line 3"):
        for item in prefetched(items()):
            got.append(item)
    assert got == [1, 2]
    for item in prefetched(iter(range(10**6))):
        if item == 3:
            break
    assert not any(t.name == "harvest-rows" for t in threading.enumerate())


# ---------------------------------------------------------------- resume and refusals


def shard_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*.safetensors"))}


def test_a_stopped_harvest_resumes_to_the_same_files(corpus: Corpus, harvested: Path, tmp_path: Path) -> None:
    out = tmp_path / "activations"
    calls = iter(range(100))
    stopped = run(corpus, out, stop_requested=lambda: next(calls) >= 6)  # checked before each shard, after each batch
    assert not stopped.complete and stopped.computed == 3  # shards 0-2 written, then it stops
    assert sorted(p.name for p in (out / "token_ids").iterdir()) == [f"shard-{k:05d}.safetensors" for k in range(3)]
    with pytest.raises(ConfigError, match="unfinished harvest"):
        surgery.activations.open(out)
    resumed = run(corpus, out)
    total = len(resumed.manifest["shards"])
    assert resumed.complete and resumed.computed == total - 3
    assert shard_files(out) == shard_files(harvested)  # bit for bit what one uninterrupted run wrote
    assert run(corpus, out).computed == 0  # complete: nothing left to do


def test_a_larger_limit_tokens_extends_a_finished_harvest(corpus: Corpus, harvested: Path, tmp_path: Path) -> None:
    out = tmp_path / "activations"
    assert run(corpus, out, limit_tokens=12 * CONTEXT).computed == 2  # shards of 8 and 4 rows
    extended = run(corpus, out, limit_tokens=24 * CONTEXT)
    assert extended.complete and extended.computed == 2  # shard 1 again (4 rows -> 8), shard 2 new
    full = shard_files(harvested)
    assert shard_files(out) == {k: v for k, v in full.items() if k.split("shard-")[1] < "00003"}


def test_a_list_of_indices_gives_those_items_batched(harvested: Path) -> None:
    for by in ("token", "row"):
        data = surgery.activations.open(harvested, by=by)
        wanted = [len(data) - 1, 0, 5, len(data) // 2, 5]  # across shards, out of order, repeated
        batch = data[wanted]
        for name in batch:
            assert torch.equal(batch[name], torch.stack([data[i][name] for i in wanted])), (by, name)
    tokens = surgery.activations.open(harvested)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(tokens), 64, drop_last=False)
    seen = torch.cat([b["token"] for b in torch.utils.data.DataLoader(tokens, batch_size=None, sampler=sampler)])
    assert sorted(seen.tolist()) == sorted(tokens[list(range(len(tokens)))]["token"].tolist())


def test_dataloader_workers_read_the_same_items(harvested: Path) -> None:
    tokens = surgery.activations.open(harvested)
    alone = next(iter(torch.utils.data.DataLoader(tokens, batch_size=len(tokens))))
    workers = torch.utils.data.DataLoader(tokens, batch_size=100, num_workers=2)  # each maps the files itself
    together = {k: torch.cat([b[k] for b in workers]) for k in alone}
    assert all(torch.equal(together[k], alone[k]) for k in alone)


def test_a_different_model_corpus_or_config_is_refused(corpus: Corpus, harvested: Path, tmp_path: Path) -> None:
    from tests.lm_helpers import tiny_gpt2

    other = tiny_gpt2(len(corpus.tokenizer), corpus.tokenizer.eos_token_id, seed=1)
    with pytest.raises(ConfigError, match="holds a harvest of another model"):
        harvest_corpus(other, corpus.tokenizer, corpus.jsonl, harvested, SITES, context=CONTEXT, batch_size=4,
                       shard_mb=SHARD_MB, progress=False)  # fmt: skip
    with pytest.raises(ConfigError, match="holds a harvest of another config"):
        run(corpus, harvested, dtype="float16")
    with pytest.raises(ConfigError, match="holds a harvest of another corpus"):
        harvest_corpus(corpus.model, corpus.tokenizer, corpus.txt, harvested, SITES, context=CONTEXT, batch_size=4,
                       shard_mb=SHARD_MB, progress=False)  # fmt: skip
    changed = tmp_path / "corpus.jsonl"  # the same path (and so fingerprint), other text: caught by the token ids
    write_jsonl(changed, list(reversed(corpus.documents)))
    first = tmp_path / "a"
    harvest_corpus(corpus.model, corpus.tokenizer, changed, first, SITES, context=CONTEXT, batch_size=4,
                   shard_mb=SHARD_MB, progress=False, limit_tokens=8 * CONTEXT)  # fmt: skip
    write_jsonl(changed, corpus.documents)
    with pytest.raises(ConfigError, match="input.path: the corpus gives other tokens"):
        harvest_corpus(corpus.model, corpus.tokenizer, changed, first, SITES, context=CONTEXT, batch_size=4,
                       shard_mb=SHARD_MB, progress=False)  # fmt: skip


# ---------------------------------------------------------------- bad input: refused before anything is written


def bad_inputs(corpus: Corpus, tmp: Path) -> list[tuple[dict[str, Any], str]]:
    (tmp / "empty").mkdir()
    write_jsonl(tmp / "blank.jsonl", ["", ""])
    return [
        ({"path": tmp / "nowhere"}, r"input.path: '.*nowhere' does not exist"),
        ({"path": tmp / "empty"}, r"input.path: '.*empty' holds no .txt file"),
        ({"path": tmp / "blank.jsonl"}, r"input.path: the corpus holds no text"),
        ({"path": corpus.jsonl, "column": "body"}, r"input.column: line 1 of '.*corpus.jsonl' has no 'body'"),
        ({"path": corpus.datasets, "column": "body"}, r"input.column: '.*ds' has no column 'body'; its columns: text"),
        ({"context": 65}, r"input.context: 65 tokens per row, but the model has 64 positions \(max_position_embedd"),
        ({"sites": ["transformer.h.9"]}, r"harvest.sites: 'transformer.h.9' matched no module. Closest module names"),
        ({"sites": ["transformer.h.*", "transformer.h.x"]}, r"harvest.sites: 'transformer.h.x' matched no module"),
        (
            {"sites": ["transformer.h.*", "transformer.h.1"]},
            r"harvest.sites: transformer.h.1 is matched by both 'transformer.h.\*' and 'transformer.h.1'; each site",
        ),
    ]


def test_bad_inputs_are_refused_with_one_line_and_nothing_written(corpus: Corpus, tmp_path: Path) -> None:
    for change, message in bad_inputs(corpus, tmp_path):
        out = tmp_path / "out"
        options = {"context": CONTEXT, "progress": False, **change}
        path, sites = options.pop("path", corpus.jsonl), options.pop("sites", SITES)
        with pytest.raises(ConfigError, match=message) as refused:
            harvest_corpus(corpus.model, corpus.tokenizer, path, out, sites, **options)
        assert "\n" not in str(refused.value)
        assert not out.exists(), change


def test_a_disk_budget_the_harvest_would_pass_is_refused_before_the_first_shard(corpus: Corpus, tmp_path: Path) -> None:
    out = tmp_path / "out"
    refused = pytest.raises(ConfigError, match=r"input.limit_tokens: the run would")
    with enforced(Limits(disk_gb=20_000 / 2**30)), refused:
        run(corpus, out, limit_tokens=40 * CONTEXT)  # 40 rows × 2 sites × 2 KiB: 160 KiB past 20 KB
    assert not out.exists()
    with enforced(Limits(disk_gb=2_000 / 2**30)), pytest.raises(ConfigError, match=r"harvest.shard_mb: the run would"):
        run(corpus, out)  # no limit_tokens: the first shard alone is past the budget
    assert not out.exists()


# ---------------------------------------------------------------- the CLI


def cli_args(corpus: Corpus, *more: str) -> list[str]:
    return ["+model=hf", f"model.path={corpus.lm}", "+input=text_dataset", f"input.path={corpus.jsonl}",
            f"input.context={CONTEXT}", "input.batch_size=4", "mode=harvest", f"harvest.sites=[{','.join(SITES)}]",
            *more]  # fmt: skip


def test_the_cli_harvest_equals_the_python_one(corpus: Corpus, harvested: Path, tmp_path: Path) -> None:
    from surgery.app.job import run_job
    from tests.test_cli import composed

    out = tmp_path / "run"
    cfg = composed(*cli_args(corpus, f"harvest.shard_mb={SHARD_MB}"))
    report = run_job(cfg, out)
    assert report["mode"] == "harvest" and report["complete"] and report["shards"] == report["computed"]
    manifest = json.loads((out / "activations" / "manifest.json").read_text())
    assert (
        manifest["fingerprints"]["tokens"]
        == json.loads((harvested / "manifest.json").read_text())["fingerprints"]["tokens"]
    )
    assert shard_files(out / "activations") == shard_files(harvested)  # the saved LM is the one in memory


def test_safe_mode_refuses_a_harvest_past_its_disk_budget_before_writing(corpus: Corpus, tmp_path: Path) -> None:
    from surgery.app.job import run_job
    from tests.test_cli import composed

    out = tmp_path / "run"
    args = ["+model=gpt2_tiny", "+input=text_dataset", f"input.path={corpus.jsonl}", f"input.tokenizer={corpus.lm}",
            f"input.context={CONTEXT}", "mode=harvest", "harvest.sites=[transformer.h.*]", "safe=true"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"^harvest.shard_mb: the run would write .* more than limits.disk_gb=2e-05"):
        run_job(composed(*args, "limits.disk_gb=0.00002"), out)
    assert not (out / "activations").exists()
    assert run_job(composed(*args), out)["complete"]  # safe mode's 8 GB default admits it


def test_cli_bad_input_exits_2_with_one_line(corpus: Corpus, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "surgery", *cli_args(corpus, "input.column=body", f"hydra.run.dir={out}")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    message = f"error: input.column: line 1 of '{corpus.jsonl}' has no 'body' (it has text)"
    assert done.stderr.strip().splitlines() == [message]
    assert not (out / "activations").exists()


def test_sigint_stops_after_a_batch_and_leaves_a_resumable_harvest(
    corpus: Corpus, harvested: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import surgery.harvest.run as harvest_run
    from surgery.app.job import run_job
    from tests.test_cli import composed

    out = tmp_path / "run"
    cfg = composed(*cli_args(corpus, f"harvest.shard_mb={SHARD_MB}"))
    real, seen = harvest_run.site_tensor, []

    def site_tensor(*args: Any) -> torch.Tensor:
        seen.append(1)
        if len(seen) == 2 + 2 * 5:  # the probe's 2 sites, then batch 4's second site: shard 2's first batch
            signal.raise_signal(signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(harvest_run, "site_tensor", site_tensor)
    with pytest.raises(SystemExit) as stopped:
        run_job(cfg, out)
    assert stopped.value.code == 130
    assert sorted(p.name for p in (out / "activations" / "token_ids").iterdir()) == [
        "shard-00000.safetensors", "shard-00001.safetensors"]  # fmt: skip
    assert not list(out.rglob(".*.tmp"))
    monkeypatch.setattr(harvest_run, "site_tensor", real)
    report = run_job(cfg, out)
    assert report["complete"] and report["computed"] == report["shards"] - 2
    assert shard_files(out / "activations") == shard_files(harvested)


# ---------------------------------------------------------------- docs/activations.md's SAE loop


def test_the_docs_sae_loop_runs_over_a_harvest(harvested: Path) -> None:
    import re

    text = (REPO / "docs" / "activations.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    loop = next(b for b in blocks if "SparseAutoencoder" in b)
    loop = loop.replace("outputs/2026-11-26/10-00-00/activations", str(harvested))
    namespace: dict[str, Any] = {}
    exec(compile(loop, "docs/activations.md", "exec"), namespace)  # noqa: S102 - our own documentation
    assert namespace["loss"].item() < namespace["first"]


# ---------------------------------------------------------------- a GPU


@pytest.mark.cuda
def test_a_cuda_harvest_equals_the_cpu_harvest(
    corpus: Corpus, harvested: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy

    import surgery.harvest.run as harvest_run

    real, pinned = harvest_run._Loop._write, []

    def write(self: Any, number: int, tokens: Any, buffers: dict[str, torch.Tensor], copied: Any = None) -> None:
        pinned.extend(b.is_pinned() for b in buffers.values())  # copied from the GPU into page-locked memory
        pinned.append(copied is not None)  # and the writer waits for those copies, not the main thread
        real(self, number, tokens, buffers, copied)

    monkeypatch.setattr(harvest_run._Loop, "_write", write)
    model = copy.deepcopy(corpus.model).to("cuda")
    harvest_corpus(model, corpus.tokenizer, corpus.jsonl, tmp_path / "gpu", SITES, context=CONTEXT, batch_size=4,
                   shard_mb=SHARD_MB, progress=False)  # fmt: skip
    cpu, gpu = surgery.activations.open(harvested, by="row"), surgery.activations.open(tmp_path / "gpu", by="row")
    assert len(cpu) == len(gpu) and cpu.manifest["fingerprints"]["tokens"] == gpu.manifest["fingerprints"]["tokens"]
    for i in range(len(cpu)):
        assert torch.equal(cpu[i]["input_ids"], gpu[i]["input_ids"])
        for site in SITES:
            torch.testing.assert_close(gpu[i][site], cpu[i][site], rtol=1e-4, atol=1e-5)
    assert pinned and all(pinned)
