"""The hostile corpus, measured: one attack per class of issue 38, each run as its author would hand it over.

``python -m scripts.hostile [--only NAME,NAME] [--json OUT]``: every case builds its files in a fresh
directory (``start/`` where the run starts, ``outside/`` holding a secret and a tensor file the attack
reaches for), runs ``python -m surgery ...`` (or ``surgery.replay``, ``surgery.sweep``, a Python call)
with a time limit, and records the exit status, the lines on stderr, whether a traceback was printed,
whether anything outside changed, wall time and the child's peak RSS. A case passes when it is
refused in one line with exit 2, or (``ok`` cases) runs, and nothing outside changed. The table it prints
is what docs/sharing.md reports; tests/test_hostile_script.py runs a sample in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT_S = 60
SECRET = "s3cr3t-value"


@dataclass
class Case:
    """An attack: what it builds under ``root`` and the command it runs in ``root/start``."""

    name: str
    cls: str  # the class of issue 38 it belongs to
    build: Callable[[Path], list[str]]  # writes the files; returns the command (after the python executable)
    expect: str = "refused"  # refused: exit 2, one line | ok: exit 0
    fragment: str = ""  # the refusal must say this


@dataclass
class Result:
    name: str
    cls: str
    passed: bool
    exit: int | None
    lines: int
    traceback: bool
    outside_changed: bool
    seconds: float
    peak_mib: float
    said: str = field(default="")


def _tensor_file(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"k": torch.ones(10)}, str(path))


def _layout(root: Path) -> Path:
    start, outside = root / "start", root / "outside"
    (start / "conf" / "experiment").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    _tensor_file(outside / "w.safetensors")
    return start


def _experiment(root: Path, body: str) -> list[str]:
    start = _layout(root)
    (start / "conf" / "experiment" / "x.yaml").write_text("# @package _global_\n" + body)
    return ["-m", "surgery", "--config-dir", "conf", "+model=cnn", "+input=random", "+experiment=x", "safe=true"]


PATCH = "{kind: modify_output, select: classifier.1, op: add, from: {file: FILE, key: k}}"


def placeholder(root: Path) -> list[str]:
    grid = "study: {grid: {f: ['../outside/w.safetensors']}, metrics: [kl]}\n"
    return _experiment(root, grid + "actions: {p: " + PATCH.replace("FILE", "'{f}'") + "}\n")


def interpolation(root: Path) -> list[str]:
    return _experiment(root, "actions: {p: " + PATCH.replace("FILE", "'${now:..}/outside/w.safetensors'") + "}\n")


def link_in_start(root: Path) -> list[str]:
    command = _experiment(root, "actions: {p: " + PATCH.replace("FILE", "w.safetensors") + "}\n")
    (root / "start" / "w.safetensors").symlink_to(root / "outside" / "w.safetensors")
    return command


def plots_link(root: Path) -> list[str]:
    command = _experiment(root, "actions: {c: {kind: capture, select: block3, plot: true}}\n")
    (root / "start" / "run").mkdir()
    (root / "start" / "run" / "plots").symlink_to(root / "outside")
    return [*command, "hydra.run.dir=run"]


def hydra_link(root: Path) -> list[str]:
    _layout(root)
    (root / "start" / "run").mkdir()
    (root / "start" / "run" / ".hydra").symlink_to(root / "outside")
    return ["-m", "surgery", "+model=cnn", "+input=random", "hydra.run.dir=run"]


def huge_grid(root: Path) -> list[str]:
    return _experiment(root, "study: {grid: {a: '0:1000', b: '0:100'}, metrics: [kl]}\n"
                             "actions: {p: {kind: modify_output, select: classifier.1, op: add, value: '{a}',"
                             " index: '[:, {b}]'}}\n")  # fmt: skip


def huge_range(root: Path) -> list[str]:
    return _experiment(
        root,
        "study: {grid: {a: '0:1000000000000'}, metrics: [kl]}\n"
        "actions: {p: {kind: modify_output, select: classifier.1, op: add, value: '{a}'}}\n",
    )


def now_format(root: Path) -> list[str]:
    return _experiment(root, "note: '${now:" + "%Y" * 450_000 + "}'\n")


def huge_model_dir(root: Path) -> list[str]:
    start = _layout(root)
    model = start / "model"
    model.mkdir()
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 10**9, "n_embd": 64,
              "n_head": 4, "vocab_size": 100}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    (start / "conf" / "experiment" / "x.yaml").write_text(
        "# @package _global_\nmodel: {path: model}\ninput: {kind: random}\n"
    )
    return ["-m", "surgery", "--config-dir", "conf", "+model=hf", "+experiment=x", "safe=true"]


def config_json_link(root: Path) -> list[str]:
    start = _layout(root)
    (start / "model").mkdir()
    (start / "model" / "config.json").symlink_to(root / "outside" / "secret.txt")
    (start / "conf" / "experiment" / "x.yaml").write_text(
        "# @package _global_\nmodel: {path: model}\ninput: {kind: random}\n"
    )
    return ["-m", "surgery", "--config-dir", "conf", "+model=hf", "+experiment=x", "safe=true"]


def _corpus(root: Path, write: Callable[[Path], None]) -> list[str]:
    start = _layout(root)
    (start / "corpus").mkdir()
    write(start / "corpus")
    return ["-m", "surgery", "+model=induction_lm", "mode=harvest", "+input=text_dataset", "input.path=corpus",
            "input.limit_tokens=64", "input.context=8", "harvest.sites=[@resid_post.0]", "safe=true"]  # fmt: skip


def long_line(root: Path) -> list[str]:
    return _corpus(root, lambda d: (d / "a.txt").write_text("w1 " * (8 * 2**20)))


def bad_utf8(root: Path) -> list[str]:
    return _corpus(root, lambda d: (d / "a.txt").write_bytes(b"w1 w2\nw3 \xff\xfe w4\n"))


def corpus_link(root: Path) -> list[str]:
    return _corpus(root, lambda d: (d / "a.txt").symlink_to(root / "outside" / "secret.txt"))


def fifo_input(root: Path) -> list[str]:
    start = _layout(root)
    os.mkfifo(start / "x.pt")
    (start / "conf" / "experiment" / "x.yaml").write_text("# @package _global_\ninput: {kind: file, path: x.pt}\n")
    return ["-m", "surgery", "--config-dir", "conf", "+model=cnn", "+experiment=x", "safe=true"]


def _sae(root: Path, cfg: str) -> list[str]:
    start = _layout(root)
    (start / "sae").mkdir()
    (start / "sae" / "cfg.json").write_text(cfg)
    _tensor_file(start / "sae" / "sae_weights.safetensors")
    return _experiment_in(start, "actions: {s: {kind: splice, select: block3, module: {path: sae}}}\n")


def _experiment_in(start: Path, body: str) -> list[str]:
    (start / "conf" / "experiment" / "x.yaml").write_text("# @package _global_\n" + body)
    return ["-m", "surgery", "--config-dir", "conf", "+model=cnn", "+input=random", "+experiment=x", "safe=true"]


def cfg_architecture_list(root: Path) -> list[str]:
    return _sae(root, '{"architecture": [], "d_in": 4, "d_sae": 8}')


def cfg_nan(root: Path) -> list[str]:
    return _sae(root, '{"architecture": "topk", "k": NaN}')


def cfg_huge(root: Path) -> list[str]:
    return _sae(root, '{"d_in": 4, "pad": "' + "a" * (16 * 2**20) + '"}')


def tokenizer_regex(root: Path) -> list[str]:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    start = _layout(root)
    raw = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+$"), behavior="isolated")  # past Oniguruma's retry limit
    raw.save(str(start / "tokenizer.json"))
    (start / "conf" / "experiment" / "x.yaml").write_text(
        "# @package _global_\ninput: {kind: text, prompt: '" + "a" * 40 + "!', tokenizer: tokenizer.json}\n"
    )
    return ["-m", "surgery", "--config-dir", "conf", "+model=induction_lm", "+experiment=x", "safe=true"]


def adapter_regex(root: Path) -> list[str]:
    start = _layout(root)
    adapter = start / "adapter"
    adapter.mkdir()
    pattern = {"(a+)+$": 4}  # backtracks exponentially on a long name of a's, were it evaluated
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "rank_pattern": pattern}
    ))  # fmt: skip
    _tensor_file(adapter / "adapter_model.safetensors")
    (start / "conf" / "experiment" / "x.yaml").write_text(
        "# @package _global_\nactions:\n  l: {kind: lora, select: 'model.layers.*.self_attn.q_proj',"
        " init: {from: adapter}}\n"
    )
    return ["-m", "surgery", "--config-dir", "conf", "+model=induction_lm", "+experiment=x", "safe=true"]


def alias_bomb(root: Path) -> list[str]:
    start = _layout(root)
    run = start / "their_run"
    (run / ".hydra").mkdir(parents=True)
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]
    (run / ".hydra" / "config.yaml").write_text("\n".join(lines) + "\n")
    (run / "report.json").write_text("{}")
    return ["-m", "surgery.replay", "their_run"]


def sweep_many(root: Path) -> list[str]:
    start = _layout(root)
    sweep = start / "sweep"
    for i in range(4000):
        job = sweep / str(i)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- a={i}\n- b={i}\n")
        (job / "report.json").write_text(json.dumps({"mode": "run", "agreement": {"after": 1.0}}))
    return ["-m", "surgery.sweep", "sweep", "--metric", "agreement.after"]


CASES = [
    Case("placeholder", "paths after substitution", placeholder, fragment="outside the start directory"),
    Case("interpolation", "paths after substitution", interpolation, fragment="outside the start directory"),
    Case("link_in_start", "symlinks on read", link_in_start, fragment="a symlink to"),
    Case("config_json_link", "symlinks on read", config_json_link, fragment="link"),
    Case("corpus_link", "symlinks on read", corpus_link, fragment="link"),
    Case("plots_link", "writes through links", plots_link, fragment="symlink in the run directory"),
    Case("hydra_link", "writes through links", hydra_link, fragment="symlink in the run directory"),
    Case("fifo_input", "regular files only", fifo_input, fragment="not a regular file"),
    Case("huge_grid", "costs before work", huge_grid, fragment="limits.count"),
    Case("huge_range", "costs before work", huge_range, fragment="limits.count"),
    Case("now_format", "costs before work", now_format),
    Case("huge_model_dir", "costs before work", huge_model_dir, fragment="limits.memory_gb"),
    Case("long_line", "costs before work", long_line, fragment="longer than"),
    Case("sweep_many", "costs before work", sweep_many, expect="ok"),
    Case("bad_utf8", "hostile contents", bad_utf8, fragment="not valid UTF-8"),
    Case("cfg_architecture_list", "hostile contents", cfg_architecture_list),
    Case("cfg_nan", "hostile contents", cfg_nan, fragment="NaN"),
    Case("cfg_huge", "hostile contents", cfg_huge, fragment="MiB"),
    Case("tokenizer_regex", "hostile contents", tokenizer_regex, fragment="native library"),
    Case("adapter_regex", "hostile contents", adapter_regex, fragment="a regular expression kind: lora does not"),
    Case("alias_bomb", "hostile contents", alias_bomb),
]


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.rglob("*")) if p.is_file()}


def _reap(child: subprocess.Popen, limit_s: float) -> tuple[int, resource.struct_rusage]:
    """Wait for ``child`` (killed past ``limit_s``); its wait status and resource usage."""
    deadline = time.monotonic() + limit_s
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
            return status, usage
        if time.monotonic() > deadline:
            child.kill()
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
            return status, usage
        time.sleep(0.02)


def run_case(case: Case, root: Path, limit_s: float = LIMIT_S) -> Result:
    """Build the case under ``root`` and run it, measured."""
    command = case.build(root)
    before = _snapshot(root / "outside")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0"}
    started = time.perf_counter()
    with open(root / "stderr", "wb") as err, open(root / "stdout", "wb") as out:  # noqa: PTH123 - a script
        child = subprocess.Popen([sys.executable, *command], cwd=root / "start", env=env, stdout=out, stderr=err)
        status, usage = _reap(child, limit_s)  # this child's own peak RSS (wait4), not the largest child so far
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss / 1024
    stderr = (root / "stderr").read_text(errors="replace")
    lines = [line for line in stderr.splitlines() if line.strip()]
    changed = _snapshot(root / "outside") != before
    refused = code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and case.fragment in lines[0]
    passed = (refused if case.expect == "refused" else code == 0) and not changed and SECRET not in stderr
    return Result(case.name, case.cls, passed, code, len(lines), "Traceback" in stderr, changed, seconds, peak,
                  lines[-1][:160] if lines else "")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the corpus (or ``--only`` some), print the table, write ``--json``; exit 1 if any case fails."""
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m scripts.hostile")
    parser.add_argument("--only", default="")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    chosen = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    results = []
    for case in chosen:
        with tempfile.TemporaryDirectory(prefix=f"hostile-{case.name}-") as tmp:
            results.append(run_case(case, Path(tmp)))
        r = results[-1]
        print(f"{'ok  ' if r.passed else 'FAIL'} {r.name:22} exit {r.exit} lines {r.lines} {r.seconds:6.2f} s"
              f" {r.peak_mib:7.0f} MiB  {r.said}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([vars(r) for r in results], indent=2) + "\n")
    failed = [r.name for r in results if not r.passed]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
