"""The GPU part of scripts/bench/gpu.py for harvest: ``harvest_corpus`` tokens/s against the bare forward's.

A seeded corpus of random words (scripts/bench/harvest.py's), packed into rows of 128 tokens, 8 rows a
batch, through the GPT-2-small-shaped model on the GPU: ``surgery.harvest.harvest_corpus`` of one mid
block's output (the usual SAE site) and of all 12 blocks, stored as float16 (reading and tokenizing the
corpus, the forward, the copy to the host, the dtype conversion and the shard writes included),
against ``model(input_ids=batch)`` on the same rows already tokenized and on the GPU. Wall time, the
device synchronised; interleaved rounds; medians.
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
    """Tokens/s of harvest (one site and every block) and of the bare forward on the same rows; their ratios."""
    import torch
    from surgery.harvest import harvest_corpus
    from surgery.harvest.config import TextDatasetInput
    from surgery.harvest.corpus import TextCorpus, packed_rows

    from scripts.bench.harvest import make_corpus, word_tokenizer

    tokens = BATCH * CONTEXT * (10 if quick else 60)
    scratch = Path(tempfile.mkdtemp(prefix="harvest-gpu-"))
    try:
        corpus = make_corpus(scratch, 400 if quick else 1500)
        tokenizer = word_tokenizer()
        opened = TextCorpus.open(TextDatasetInput(path=str(corpus), context=CONTEXT))
        rows = torch.stack(list(packed_rows(tokenizer, opened.documents(), CONTEXT, tokens))).to(model.device)
        batches = list(rows.split(BATCH))

        def bare() -> None:
            with torch.no_grad():
                for batch in batches:
                    model(input_ids=batch, use_cache=False)

        def harvest(sites: list[str]) -> Any:
            out = scratch / "acts"
            shutil.rmtree(out, ignore_errors=True)
            return harvest_corpus(model, tokenizer, corpus, out, sites, context=CONTEXT, limit_tokens=rows.numel(),
                                  batch_size=BATCH, dtype="float16", shard_mb=64, progress=False)  # fmt: skip

        variants = {"bare forward": bare, "harvest, one block": lambda: harvest(["transformer.h.6"]),
                    "harvest, every block": lambda: harvest(["transformer.h.*"])}  # fmt: skip
        for run in variants.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(2 if quick else 5):
            for name in list(variants) if r % 2 == 0 else list(reversed(variants)):
                torch.cuda.synchronize()
                begin = time.perf_counter()
                variants[name]()
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - begin)
        tps = {name: rows.numel() / statistics.median(t) for name, t in times.items()}
        return {
            "tokens": int(rows.numel()),
            "sites": 1,
            "harvest_tps": tps["harvest, one block"],
            "forward_tps": tps["bare forward"],
            "ratio": tps["harvest, one block"] / tps["bare forward"],
            "every_block_tps": tps["harvest, every block"],
            "every_block_ratio": tps["harvest, every block"] / tps["bare forward"],
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
