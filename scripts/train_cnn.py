"""Train the built-in CNN on the digits train split and write surgery/models/weights/cnn_digits.safetensors.

    .venv/bin/python scripts/train_cnn.py            # train and write the checkpoint (about a minute)
    .venv/bin/python scripts/train_cnn.py --check    # train again and compare with the shipped checkpoint

One thread, a fixed seed and a fixed data order: on the same machine the checkpoint is reproduced
bit for bit (--check prints the largest weight difference; other CPUs may differ in the last bits).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from surgery.data.sources import digits  # noqa: E402
from surgery.models.cnn import CNN, WEIGHTS  # noqa: E402

SEED = 0
EPOCHS = 12
BATCH = 32
LR = 3e-3


def train() -> CNN:
    """The CNN trained with Adam on the 1438 train digits (28×28), fixed order per epoch from ``SEED``."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    data = digits("train", (1, 28, 28))
    x, y = data.tensors
    model = CNN()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    order_gen = torch.Generator().manual_seed(SEED)
    for _ in range(EPOCHS):
        model.train()
        order = torch.randperm(len(y), generator=order_gen)
        for start in range(0, len(y), BATCH):
            idx = order[start : start + BATCH]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def accuracy(model: CNN, split: str) -> float:
    """Share of ``split`` digits classified correctly."""
    x, y = digits(split, (1, 28, 28)).tensors
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped checkpoint, write nothing")
    args = parser.parse_args()
    from safetensors.torch import load_file, save_file

    model = train()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    print(f"train accuracy {accuracy(model, 'train'):.4f}, test accuracy {accuracy(model, 'test'):.4f}")
    if args.check:
        shipped = load_file(str(WEIGHTS))
        worst = max(float((state[k].double() - shipped[k].double()).abs().max()) for k in shipped)
        print(f"largest difference from {WEIGHTS.relative_to(ROOT)}: {worst:.3g}")
        return 0 if worst == 0 else 1
    save_file(state, str(WEIGHTS))
    print(f"wrote {WEIGHTS.relative_to(ROOT)} ({WEIGHTS.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
