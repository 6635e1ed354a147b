"""Train the built-in induction language model and write surgery/models/weights/induction_lm/.

    .venv/bin/python scripts/train_induction_lm.py            # train and write the directory (a minute or two)
    .venv/bin/python scripts/train_induction_lm.py --check    # train again and compare with the shipped weights

A 2-layer Llama (rotary positions, so no absolute position to read) learns repeated random token
sequences: ``<bos> p s s`` where ``p`` is 0 to 8 words and ``s`` 4 to 12 more, all distinct, drawn from
``w0``..``w63``. ``p`` and the first copy are unpredictable; the second copy is predictable only from the
first (induction), and since neither its start nor its length is fixed the model has to find the earlier
occurrence of the current word by content. It learns the textbook circuit: a previous-token head in block
0 and induction heads in block 1 (the script prints each head's score). Training stops at a fixed number
of steps; the script then measures next-token accuracy on fresh sequences and fails unless the repeated
half is above 95 % and block 0 has a previous-token head.

(Until session 13 the model was a GPT-2 trained with the copy always right after ``<bos>``: with absolute
positions to read it found the repeat by position and formed no previous-token head, so its circuit was
not the one induction is known for.)

One thread, a fixed seed and a fixed data order: on the same machine the weights are reproduced bit for
bit (--check prints the largest weight difference; other CPUs may differ in the last bits).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from surgery.models.induction import (  # noqa: E402
    BOS,
    PAD,
    UNK,
    WEIGHTS,
    WORDS,
    repeated_sequences,
)

SEED = 0
STEPS = 2500
BATCH = 64
LR = 3e-3
WARMUP = 100
MIN_ACCURACY = 0.95
POSITIONS = 64  # rotary: a limit for prompts, not a table; training rows are at most 33 tokens
MIN_PREVIOUS = 0.8  # block 0's best head attends to the previous token at least this much on average


def word_tokenizer():  # type: ignore[no-untyped-def]
    """The word-level tokenizer: ``w0``..``w63`` are ids 0..63, then ``<bos>``, ``<pad>``, ``<unk>``.

    Text is split on whitespace (so " w44" is exactly the token ``w44``) and every encoded text starts with
    ``<bos>``, as in training; metric tokens are encoded without it.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(WORDS)} | {BOS: WORDS, PAD: WORDS + 1, UNK: WORDS + 2}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, pad_token=PAD, unk_token=UNK, model_max_length=POSITIONS
    )


def save_tokenizer(directory: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json, the class named as every transformers 4.46+ knows it."""
    word_tokenizer().save_pretrained(directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 writes its new name TokenizersBackend
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def fresh_model():  # type: ignore[no-untyped-def]
    """A randomly initialised 2-layer, 4-head Llama of width 64 over the 67-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=WORDS + 3,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=WORDS,
        eos_token_id=WORDS,
        pad_token_id=WORDS + 1,
        use_cache=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def train():  # type: ignore[no-untyped-def]
    """The model trained with AdamW on freshly drawn batches, the draws fixed by ``SEED``."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    model = fresh_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / WARMUP) * max(0.1, 1 - step / STEPS)
    )
    data = torch.Generator().manual_seed(SEED)
    model.train()
    for step in range(STEPS):
        ids, mask, _ = repeated_sequences(BATCH, data)
        logits = model(input_ids=ids, attention_mask=mask).logits
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if step % 500 == 0 or step == STEPS - 1:
            model.eval()
            _, repeated = repeated_half_accuracy(model, torch.Generator().manual_seed(SEED + 2), rows=200)
            model.train()
            print(f"step {step:5d}  loss {loss.item():.4f}  repeated-half accuracy {repeated:.3f}", flush=True)
    return model.eval()


def repeated_half_accuracy(model, generator: torch.Generator, rows: int = 2000) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Next-token accuracy on fresh sequences: (everything before the repeat, the repeat).

    The first leaves out the first word (after ``<bos>``), the second the first word of the repeat (nothing
    predicts where it starts).
    """
    ids, mask, starts = repeated_sequences(rows, generator)
    with torch.no_grad():
        guess = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    right = guess[:, :-1] == ids[:, 1:]  # right[:, t]: the prediction at t of the token at t + 1
    first = repeated = total_first = total_repeated = 0
    for row, (end, start) in enumerate(zip(mask.sum(1).tolist(), starts.tolist(), strict=True)):
        again = start + (end - start) // 2  # where the second copy starts
        first += int(right[row, 1 : again - 1].sum())  # targets: every word before the repeat but the first
        repeated += int(right[row, again : end - 1].sum())  # targets s[1:] of the second copy
        total_first += again - 2
        total_repeated += end - 1 - again
    return first / total_first, repeated / total_repeated


def head_scores(model, generator: torch.Generator, rows: int = 500) -> tuple[list[float], list[float]]:  # type: ignore[no-untyped-def]
    """Block 0's previous-token scores and block 1's induction scores, per head.

    A previous-token score is the mean attention from each word to the one before it; an induction score the
    mean attention from each word of the second copy to the word after its earlier occurrence.
    """
    ids, mask, starts = repeated_sequences(rows, generator)
    with torch.no_grad():
        attentions = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    previous = torch.zeros(attentions[0].shape[1], dtype=torch.float64)
    induction = torch.zeros_like(previous)
    count_previous = count_induction = 0
    for row, (end, start) in enumerate(zip(mask.sum(1).tolist(), starts.tolist(), strict=True)):
        size = (end - start) // 2
        query = torch.arange(2, end)
        previous += attentions[0][row, :, query, query - 1].double().sum(-1)
        count_previous += len(query)
        query = torch.arange(start + size, end)
        induction += attentions[1][row, :, query, query - size + 1].double().sum(-1)
        count_induction += len(query)
    return (previous / count_previous).tolist(), (induction / count_induction).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped weights, write nothing")
    args = parser.parse_args()
    from safetensors.torch import load_file

    model = train()
    first, repeated = repeated_half_accuracy(model, torch.Generator().manual_seed(SEED + 1))
    print(f"next-token accuracy on fresh sequences: before the repeat {first:.4f}, the repeat {repeated:.4f}")
    previous, induction = head_scores(model, torch.Generator().manual_seed(SEED + 3))
    print("block 0 previous-token score per head: " + " ".join(f"{x:.2f}" for x in previous))
    print("block 1 induction score per head:      " + " ".join(f"{x:.2f}" for x in induction))
    if repeated < MIN_ACCURACY:
        print(f"the repeated half should be above {MIN_ACCURACY}: no induction learned")
        return 1
    if max(previous) < MIN_PREVIOUS:
        print(f"no head of block 0 attends to the previous token (best {max(previous):.2f} < {MIN_PREVIOUS})")
        return 1
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            state = load_file(str(Path(tmp) / "model.safetensors"))
        shipped = load_file(str(WEIGHTS / "model.safetensors"))
        worst = max(float((state[k].double() - shipped[k].double()).abs().max()) for k in shipped)
        print(f"largest difference from {WEIGHTS.relative_to(ROOT)}: {worst:.3g}")
        return 0 if worst == 0 and set(state) == set(shipped) else 1
    WEIGHTS.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(WEIGHTS)
    save_tokenizer(WEIGHTS)
    size = sum(p.stat().st_size for p in WEIGHTS.iterdir())
    print(f"wrote {WEIGHTS.relative_to(ROOT)}/ ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
