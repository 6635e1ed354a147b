"""Section 14 of BENCHMARKS.md: ``mode=harvest`` against the bare forward, memory at 1× and 10×, read-back."""

from __future__ import annotations

from typing import Any

from scripts.bench.report.markdown import load_note, table, yes

TITLE = "## 15. Activation datasets: harvesting a corpus"


VIEWS = {
    "token": '`by="token"`, `DataLoader(batch_size=256, shuffle=True)`',
    "token, batched": '`by="token"`, `data[indices]` a batch (`BatchSampler` of 256, `batch_size=None`)',
    "row": '`by="row"`, `DataLoader(batch_size=2, shuffle=True)`',
}
JUDGED = "token, batched"  # the read-back target is judged on the documented fast path (older results: "token")


def harvest_section(data: dict[str, Any] | None) -> tuple[list[str], list[list[str]], list[str]]:
    """The section, its target rows and its misses (each miss starts with ``harvest:``)."""
    if data is None:
        return [TITLE, "", "Not run.", ""], [], []
    m = data["model"]
    cpu, wall = data["cpu_s"], data["wall_s"]
    low, high = data["quartiles"]
    mem = data["memory"]
    rss = data["rss_ratio"]
    read = data["read"]
    md = [
        TITLE,
        "",
        f"`scripts/bench/harvest.py`. A GPT-2-shaped model ({m['layers']} layers, width {m['width']}, {m['heads']}"
        f" heads, eager attention, random weights, torch on one thread), a word-level tokenizer and a .jsonl corpus"
        f" of random words; rows of {m['context']} tokens, {m['batch']} rows a batch. `harvest` is"
        " `surgery.harvest.harvest_corpus` of every block's output (`transformer.h.*`, 4 sites) stored as"
        f" {m['dtype']}, shards of {m['shard_mb']} MiB: reading and tokenizing the corpus, planning, the forward,"
        " capture, dtype conversion and writing the shards (a background thread) all included. `bare forward` is"
        " `model(input_ids=batch)` by hand on the same batches, already tokenized. Interleaved, median of"
        f" {data['rounds']} rounds; CPU time of the process (the writer thread's included) and wall time."
        f" {load_note(data).strip()}",
        "",
        *table(
            ["variant", "tokens", "CPU", "wall", "tokens/s (CPU)"],
            [
                [
                    "bare forward",
                    f"{data['tokens']:,}",
                    f"{cpu['bare forward']:.2f} s",
                    f"{wall['bare forward']:.2f} s",
                    f"{data['bare_tokens_per_s']:,.0f}",
                ],
                [
                    "harvest",
                    f"{data['tokens']:,}",
                    f"{cpu['harvest']:.2f} s",
                    f"{wall['harvest']:.2f} s",
                    f"{data['harvest_tokens_per_s']:,.0f}",
                ],
            ],  # fmt: skip
        ),
        f"Harvest tokens/s over the bare forward's: {data['ratio']:.3f} ({low:.3f}–{high:.3f}) in CPU time,"
        f" {data['wall_ratio']:.3f} in wall time; it wrote {data['shards']} shards, {data['bytes'] / 2**20:.1f} MiB.",
        "",
        "Peak RSS of the same harvest in a fresh process at 1× and 10× the tokens (`shard_mb=4`, so both write"
        " several shards; the model built and run once before the harvest):",
        "",
        *table(
            ["tokens", "shards", "RSS before the harvest", "peak RSS"],
            [[f"{r['tokens']:,}", r["shards"], f"{r['before_mib']:.0f} MiB", f"{r['peak_mib']:.0f} MiB"] for r in mem],
        ),
        "Read-back: `surgery.activations.open` of the harvested dataset, one shuffled DataLoader epoch, CPU time"
        " (median of the rounds above):",
        "",
        *table(
            ["view", "items", "tokens/s", "× the harvest's tokens/s"],
            [
                [VIEWS.get(view, view), f"{r['items']:,}", f"{r['tokens_per_s']:,.0f}", f"{r['vs_harvest']:.1f}"]
                for view, r in read.items()
            ],  # fmt: skip
        ),
    ]
    throughput_met = data["ratio"] >= 0.8
    memory_met = rss <= 1.10
    judged = read.get(JUDGED) or read["token"]
    read_met = judged["vs_harvest"] >= 10
    targets = [
        ["harvest tokens/s / bare forward tokens/s (GPT-2-shaped, 4 sites, float16)", "≥ 0.80",
         f"{data['ratio']:.3f} ({low:.3f}–{high:.3f})", yes(throughput_met)],
        ["harvest peak RSS, 10× / 1× the tokens", "≤ 1.10", f"{rss:.3f}", yes(memory_met)],
        ["`surgery.activations.open` read-back / harvest, tokens/s (by token, a batch at a time)", "≥ 10",
         f"{judged['vs_harvest']:.1f}", yes(read_met)],
    ]  # fmt: skip
    misses = []
    if not throughput_met:
        misses.append(f"harvest: {data['ratio']:.2f}× the bare forward's tokens/s (section 15)")
    if not memory_met:
        misses.append(f"harvest: peak RSS {rss:.2f}× at 10× the tokens (section 15)")
    if not read_met:
        misses.append(f"harvest: read-back only {judged['vs_harvest']:.1f}× the harvest's tokens/s (section 15)")
    return md, targets, misses
