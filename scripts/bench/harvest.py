"""``mode=harvest`` against the bare forward on the same batches, memory at 1× and 10× the tokens, read-back speed.

    python -m scripts.bench.harvest [--quick] [--json out.json]

A GPT-2-shaped model (4 layers, width 256, 4 heads, eager attention, random weights, torch on one
thread) and a word-level tokenizer over a seeded corpus of random words (a .jsonl file). Rows of 128
tokens, 8 rows a batch.

* Throughput: ``surgery.harvest.harvest_corpus`` of all 4 blocks' outputs stored as float16 (reading
  and tokenizing the corpus, the forward, capture, dtype conversion and writing shards included)
  against ``model(input_ids=batch)`` by hand on the same batches, pre-tokenized. Interleaved rounds,
  CPU time of this process (the writer thread included) and wall time. Target: harvest tokens/s
  ≥ 0.8 × the bare forward's.
* Memory: the same harvest of 1× and 10× the tokens, each in a fresh child process (``shard_mb=4``, so
  both write several shards); peak RSS within 10 %.
* Read-back: ``surgery.activations.open`` of the harvested dataset, one shuffled DataLoader epoch by token
  (``batch_size=256``, items collated; and whole batches from ``data[indices]`` through a ``BatchSampler``),
  and by row; tokens/s ≥ 10 × what the harvest wrote (judged on the batched path).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench.common import ROOT, machine, run_child, write_json

LAYERS, WIDTH, HEADS, CONTEXT, BATCH = 4, 256, 4, 128, 8
VOCAB_WORDS = 2000
SITES = ["transformer.h.*"]
SHARD_MB = 4
THROUGHPUT_TARGET, MEMORY_TARGET, READ_TARGET = 0.8, 1.10, 10.0


def make_corpus(directory: Path, documents: int) -> Path:
    """A .jsonl of seeded documents of 20-400 random words from a fixed list of words; its path."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(VOCAB_WORDS)]
    path = directory / "corpus.jsonl"
    with path.open("w") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(20, 400)))}) + "\n")
    return path


def word_tokenizer() -> Any:
    """A word-level tokenizer over the corpus's words (ids 0, 1: ``[UNK]``, ``<eos>``), as a transformers one."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([f"w{i}" for i in range(VOCAB_WORDS)],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"]))  # fmt: skip
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")


def setup(directory: Path) -> tuple[Any, Any]:
    """The model and the tokenizer (:func:`word_tokenizer`)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_positions=CONTEXT,
                                     vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=1)  # fmt: skip
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config).eval(), tokenizer


def harvest(model: Any, tokenizer: Any, corpus: Path, out: Path, tokens: int) -> Any:
    from surgery.harvest import harvest_corpus

    shutil.rmtree(out, ignore_errors=True)
    return harvest_corpus(model, tokenizer, corpus, out, SITES, context=CONTEXT, limit_tokens=tokens,
                          batch_size=BATCH, dtype="float16", shard_mb=SHARD_MB, progress=False)  # fmt: skip


def bare(model: Any, batches: list[Any]) -> None:
    import torch

    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch, use_cache=False)


def timed(fn: Any) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of ``fn()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def throughput(model: Any, tokenizer: Any, corpus: Path, tokens: int, rounds: int, scratch: Path) -> dict[str, Any]:
    """Bare forward and harvest on the same batches, interleaved; then read-back of the last harvest."""
    import torch

    import surgery.activations
    from surgery.harvest.config import TextDatasetInput
    from surgery.harvest.corpus import TextCorpus, packed_rows

    opened = TextCorpus.open(TextDatasetInput(path=str(corpus), context=CONTEXT))
    rows = torch.stack(list(packed_rows(tokenizer, opened.documents(), CONTEXT, tokens)))
    batches = list(rows.split(BATCH))
    bare(model, batches[:2])  # warm up both
    harvest(model, tokenizer, corpus, scratch / "warm", BATCH * CONTEXT)
    times: dict[str, list[tuple[float, float]]] = {"bare forward": [], "harvest": []}
    for r in range(rounds):
        order = ["bare forward", "harvest"] if r % 2 == 0 else ["harvest", "bare forward"]
        for name in order:
            if name == "harvest":
                times[name].append(timed(lambda: harvest(model, tokenizer, corpus, scratch / "acts", tokens)))
            else:
                times[name].append(timed(lambda: bare(model, batches)))
    done = surgery.activations.open(scratch / "acts")
    assert done.manifest["tokens"] == rows.numel()
    reads: dict[str, list[tuple[float, float]]] = {"token": [], "token, batched": [], "row": []}
    counts = {}
    for _ in range(rounds):
        for view in reads:
            data = surgery.activations.open(scratch / "acts", by=view.split(",")[0])
            if view == "token, batched":  # whole batches from data[indices]: the documented fast path
                sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), 256, drop_last=False)
                loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler)
            else:
                loader = torch.utils.data.DataLoader(data, batch_size=256 if view == "token" else 2, shuffle=True)
            counts[view] = len(data) if view != "row" else len(data) * CONTEXT
            reads[view].append(timed(lambda loader=loader: [None for _ in loader]))
    ratios = [b[0] / h[0] for b, h in zip(times["bare forward"], times["harvest"], strict=True)]
    wall_ratios = [b[1] / h[1] for b, h in zip(times["bare forward"], times["harvest"], strict=True)]
    harvest_rate = rows.numel() / statistics.median(t[0] for t in times["harvest"])
    return {
        "tokens": int(rows.numel()),
        "rounds": rounds,
        "cpu_s": {name: statistics.median(t[0] for t in v) for name, v in times.items()},
        "wall_s": {name: statistics.median(t[1] for t in v) for name, v in times.items()},
        "ratio": statistics.median(ratios),
        "quartiles": _quartiles(ratios),
        "wall_ratio": statistics.median(wall_ratios),
        "shards": len(done.manifest["shards"]),
        "bytes": sum(p.stat().st_size for p in (scratch / "acts").rglob("*.safetensors")),
        "read": {
            by: {
                "items": counts[by],
                "cpu_s": statistics.median(t[0] for t in v),
                "tokens_per_s": counts[by] / statistics.median(t[0] for t in v),
                "vs_harvest": counts[by] / statistics.median(t[0] for t in v) / harvest_rate,
            }
            for by, v in reads.items()
        },  # fmt: skip
        "harvest_tokens_per_s": harvest_rate,
        "bare_tokens_per_s": rows.numel() / statistics.median(t[0] for t in times["bare forward"]),
    }


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def child(corpus: Path, tokens: int) -> dict[str, Any]:
    """In a fresh process: build, run one forward, then harvest ``tokens``; RSS before and at the peak."""
    import torch

    model, tokenizer = setup(corpus.parent)
    bare(model, [torch.zeros(BATCH, CONTEXT, dtype=torch.int64)])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with tempfile.TemporaryDirectory() as out:
        outcome = harvest(model, tokenizer, corpus, Path(out) / "acts", tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tokens": outcome.manifest["tokens"], "shards": len(outcome.manifest["shards"]), "before_mib": before,
            "peak_mib": peak}  # fmt: skip


def memory(corpus: Path, tokens: int) -> list[dict[str, Any]]:
    rows = []
    for scale in (1, 10):
        run = run_child([sys.executable, "-m", "scripts.bench.harvest", "--child", str(tokens * scale),
                         "--corpus", str(corpus)], cwd=ROOT, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
        rows.append({"scale": scale, **json.loads(run.stdout.strip().splitlines()[-1])})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.corpus), args.child)))
        return 0
    tokens = 4 * BATCH * CONTEXT if args.quick else 16 * BATCH * CONTEXT  # 16k tokens: 128 rows, 16 batches
    rounds = 1 if args.quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        corpus = make_corpus(scratch, 400 if args.quick else 4000)  # about 840k tokens: 10× fits
        model, tokenizer = setup(scratch)
        speed = throughput(model, tokenizer, corpus, tokens, rounds, scratch)
        mem = memory(corpus, tokens)
    ratio = speed["ratio"]
    rss = mem[1]["peak_mib"] / mem[0]["peak_mib"]
    print(f"harvest / bare forward tokens/s: {ratio:.3f} (CPU; wall {speed['wall_ratio']:.3f}); target ≥ 0.8")
    print(f"peak RSS 10× / 1×: {rss:.3f} ({mem[0]['peak_mib']:.0f} → {mem[1]['peak_mib']:.0f} MiB); target ≤ 1.10")
    for view, r in speed["read"].items():
        print(f"read-back by {view}: {r['tokens_per_s']:,.0f} tokens/s, {r['vs_harvest']:.1f}× the harvest's")
    write_json(args.json, {"machine": machine(), "quick": args.quick, "model": {"layers": LAYERS, "width": WIDTH,
               "heads": HEADS, "context": CONTEXT, "batch": BATCH, "sites": SITES, "dtype": "float16",
               "shard_mb": SHARD_MB}, **speed, "memory": mem, "rss_ratio": rss})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
