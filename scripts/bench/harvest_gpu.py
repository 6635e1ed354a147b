"""The GPU part of scripts/bench/gpu.py for harvest: ``harvest_corpus`` tokens/s against the bare forward's.

A seeded corpus of random words (scripts/bench/harvest.py's), packed into rows of 128 tokens, 8 rows a
batch, through the GPT-2-small-shaped model on the GPU: ``surgery.harvest.harvest_corpus`` of one mid
block's output (the usual SAE site) and of all 12 blocks, stored as float16 (reading and tokenizing the
corpus, the forward, the copy to the host, the dtype conversion and the shard writes included),
against ``model(input_ids=batch)`` on the same rows already tokenized and on the GPU. Wall time, the
device synchronised; interleaved rounds; medians. Each is timed on 10 and on 90 batches: tokens/s is the
rate between the two (what a long harvest runs at), start-up the rest of the 10-batch time (a harvest
fingerprints the model's weights, plans and probes once); the whole-run rate at 90 batches is reported too.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

CONTEXT, BATCH = 128, 8


def harvest_vs_forward(model: Any, quick: bool) -> dict[str, Any]:
    """Harvest (one block, every block) and the bare forward at two corpus sizes: start-up and tokens/s of each."""
    import torch

    from scripts.bench.harvest import make_corpus, word_tokenizer
    from surgery.harvest import harvest_corpus
    from surgery.harvest.config import TextDatasetInput
    from surgery.harvest.corpus import TextCorpus, packed_rows

    sizes = (BATCH * CONTEXT * 10, BATCH * CONTEXT * (30 if quick else 90))
    scratch = Path(tempfile.mkdtemp(prefix="harvest-gpu-"))
    try:
        corpus = make_corpus(scratch, 300 if quick else 900)
        tokenizer = word_tokenizer()
        opened = TextCorpus.open(TextDatasetInput(path=str(corpus), context=CONTEXT))
        rows = torch.stack(list(packed_rows(tokenizer, opened.documents(), CONTEXT, sizes[1]))).to(model.device)
        assert rows.numel() == sizes[1], "the corpus is too small for the larger size"

        def bare(tokens: int) -> None:
            with torch.no_grad():
                for batch in rows[: tokens // CONTEXT].split(BATCH):
                    model(input_ids=batch, use_cache=False)

        def harvest(sites: list[str], tokens: int) -> None:
            out = scratch / "acts"
            shutil.rmtree(out, ignore_errors=True)
            harvest_corpus(model, tokenizer, corpus, out, sites, context=CONTEXT, limit_tokens=tokens,
                           batch_size=BATCH, dtype="float16", shard_mb=64, progress=False)  # fmt: skip

        variants = {"bare forward": bare, "harvest, one block": lambda n: harvest(["transformer.h.6"], n),
                    "harvest, every block": lambda n: harvest(["transformer.h.*"], n)}  # fmt: skip
        for run in variants.values():
            run(sizes[0])  # warm-up
        times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in variants for n in sizes}
        for r in range(2 if quick else 3):
            for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                for n in sizes:
                    torch.cuda.synchronize()
                    begin = time.perf_counter()
                    variants[name](n)
                    torch.cuda.synchronize()
                    times[(name, n)].append(time.perf_counter() - begin)
        small, large = sizes
        seconds = {key: statistics.median(t) for key, t in times.items()}
        rate = {name: (large - small) / (seconds[(name, large)] - seconds[(name, small)]) for name in variants}
        start = {name: seconds[(name, small)] - small / rate[name] for name in variants}
        whole = {name: large / seconds[(name, large)] for name in variants}
        return {
            "tokens": large,
            "sites": 1,
            "harvest_tps": rate["harvest, one block"],
            "forward_tps": rate["bare forward"],
            "ratio": rate["harvest, one block"] / rate["bare forward"],
            "every_block_tps": rate["harvest, every block"],
            "every_block_ratio": rate["harvest, every block"] / rate["bare forward"],
            "start_s": start,
            "whole_tps": whole,
            "whole_ratio": whole["harvest, one block"] / whole["bare forward"],
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
