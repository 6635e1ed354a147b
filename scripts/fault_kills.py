"""Kill a study, a harvest and a sweep at random moments (SIGKILL), rerun each, and compare with an unkilled run.

SPEC §19 "Faults": a study, harvest or sweep killed at any point (SIGKILL included) and rerun gives the same
bytes as an uninterrupted run; a half-written file is never read as finished. ``scripts/faults`` runs this
module; ``tests/test_fault_kills.py`` runs a small sample of it in the suite.

For each kind of job (:data:`KINDS`), in a fresh work folder:

1. the reference: the command run to completion (twice, unless ``references=1``: the two must agree, which
   shows the comparison below ignores nothing that changes by itself);
2. per trial (seeded): the same command in a fresh folder, its whole process group SIGKILLed after a delay
   drawn uniformly over the reference's duration (a first kill that comes after the job finished is drawn
   again, in an emptied folder, over the time the job took: a loaded machine makes references slow), a
   quarter of the trials killed a second time while the rerun resumes, then the command run again to
   completion in the same folder;
3. after every kill, the killed folder is checked: every file present is either temporary (``write_atomic``'s
   ``.NAME.XXXXXXXX.tmp``, never read), a resume file that parses whole (``study.partial.safetensors``, an
   unfinished ``manifest.json``), or a finished file equal to the reference's; and the readers take nothing
   half-written as finished (``surgery.activations.open`` refuses in one line or reads the reference's data;
   ``surgery.app.sweep.collect`` reads every report whole or none);
4. after the completing rerun, every file must equal the reference's, byte for byte, and no other file may
   exist (a temporary file left over is a failure).

Not compared, and why (:data:`IGNORED`, :data:`TIMING_KEYS`): Hydra's own files (``.hydra/*``, ``multirun.yaml``:
the composed config, rewritten by every start) and logs (``*.log``: timestamps); in JSON reports only the
fields that hold wall-clock times (``timings``, ``seconds``, ``study.seconds``) and a harvest's ``computed``
(how many shards *this* process computed: fewer after a resume, by design); report.html's "Run facts" section;
in report.md the "## Timings"
section (the same times, for people). Every other byte is compared.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from surgery.files.leftovers import TEMPORARY
from surgery.files.write import make_dir

REPO = Path(__file__).resolve().parents[1]
IGNORED_DIRS = (".hydra",)  # Hydra's copy of the composed config: rewritten by every start, computes nothing
IGNORED_NAMES = ("multirun.yaml",)  # Hydra's record of a sweep's config, likewise
IGNORED_SUFFIXES = (".log",)  # the job's log: timestamps
TIMING_KEYS = {  # by file name: JSON fields that hold wall-clock times, or what this process did (not the result)
    "report.json": [("timings",), ("seconds",), ("study", "seconds"), ("computed",)],
    "manifest.json": [("seconds",)],
}
TIMING_SECTIONS = {"report.md": "## Timings"}  # by file name: a markdown section of wall-clock times
# report.html's "Run facts" section holds the same wall-clock times (and environment, fingerprints: report.json's)
HTML_SECTIONS = {"report.html": (b'<section id="facts">', b"</section>")}
PROGRESSIVE = ("study.partial.safetensors",)  # replaced whole as a run goes; absent from a finished run


@dataclass(frozen=True)
class Kind:
    """One kind of job: how to set it up and its command line (after ``python -m surgery``), run in a folder."""

    name: str
    args: Callable[[Path], list[str]]  # the shared setup folder -> the arguments (the job writes into ./run)
    setup: Callable[[Path], None] = lambda root: None


def study_args(sample: bool) -> Callable[[Path], list[str]]:
    """The shipped induction-patching study; one cell a forward so its resume file is saved several times."""
    more = ["study.grid.layer=0:1", "study.ci=null"] if sample else []
    return lambda root: ["+experiment=induction_patching", "study.batch_cells=1", *more, "hydra.run.dir=run"]


def harvest_setup(documents: int) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        from tests.harvest_helpers import make_corpus

        if not (root / "corpus" / "lm").is_dir():
            make_corpus(make_dir(root / "corpus", "faults"), count=documents, datasets=False)

    return setup


def harvest_args(root: Path) -> list[str]:
    """Two sites of a tiny GPT-2 over a word corpus, a shard every 8 rows (so many shards, each written whole)."""
    corpus = root / "corpus"
    return ["+model=hf", f"model.path={corpus / 'lm'}", "+input=text_dataset", f"input.path={corpus / 'corpus.jsonl'}",
            "input.context=16", "input.batch_size=4", "mode=harvest",
            "harvest.sites=[transformer.h.0,transformer.h.1]", "harvest.shard_mb=0.02",
            "hydra.run.dir=run"]  # fmt: skip


def sweep_args(batches: int, values: str) -> Callable[[Path], list[str]]:
    """A -m sweep over the output scale: captures in memory and streamed to disk a shard a batch, the model saved."""
    return lambda root: ["-m", "+model=mlp", "+actions=[scale_output,capture]",
                         "+actions.d={kind: capture, select: head, to: disk}", f"+input.batches={batches}",
                         f"actions.scale_output.value={values}", "save_model=true", "hydra.sweep.dir=run"]  # fmt: skip


def kinds(sample: bool = False) -> dict[str, Kind]:
    """The three kinds of job; ``sample``: smaller ones, for the suite."""
    return {
        "study": Kind("study", study_args(sample)),
        "harvest": Kind("harvest", harvest_args, harvest_setup(24 if sample else 120)),
        "sweep": Kind("sweep", sweep_args(6 if sample else 30, "0.5,2" if sample else "0.5,1,2")),
    }


# ---------------------------------------------------------------- running


def command(kind: Kind, root: Path) -> list[str]:
    return [sys.executable, "-m", "surgery", *kind.args(root)]


def environment() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}


def run_to_end(kind: Kind, root: Path, folder: Path, timeout: float = 600) -> tuple[float, str]:
    """Run the command in ``folder`` to completion; (seconds, "" or what went wrong)."""
    make_dir(folder, "faults")
    clock = time.perf_counter()
    done = subprocess.run(command(kind, root), cwd=folder, env=environment(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    seconds = time.perf_counter() - clock
    if done.returncode != 0:
        return seconds, f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"
    return seconds, ""


def run_and_kill(kind: Kind, root: Path, folder: Path, delay: float) -> float | None:
    """Start the command in ``folder``, SIGKILL its process group after ``delay`` s: None when it was still running
    (the kill landed), else the seconds it took to finish first."""
    make_dir(folder, "faults")
    started = time.perf_counter()
    process = subprocess.Popen(command(kind, root), cwd=folder, env=environment(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        process.wait(timeout=delay)
        return time.perf_counter() - started  # finished first
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


# ---------------------------------------------------------------- comparing


def files_of(run: Path) -> dict[str, Path]:
    """Every regular file under ``run`` by its relative path, except Hydra's own and logs."""
    from surgery.files.gate import walk

    found = {}
    for path in walk(run, "run") if run.is_dir() else []:
        relative = path.relative_to(run)
        if any(p in IGNORED_DIRS for p in relative.parts) or relative.name in IGNORED_NAMES:
            continue
        if relative.name.endswith(IGNORED_SUFFIXES):
            continue
        found[relative.as_posix()] = path
    return found


def content(path: Path) -> Any:
    """What is compared of a file: its bytes; for a JSON report, its parse without the timing fields."""
    from surgery.files.gate import read_bytes, read_json

    if path.name in TIMING_SECTIONS:
        return _without_section(read_bytes(path, "faults", cap=None), TIMING_SECTIONS[path.name].encode())
    if path.name in HTML_SECTIONS:
        text, (start, end) = read_bytes(path, "faults", cap=None), HTML_SECTIONS[path.name]
        at = text.find(start)
        return text if at < 0 else text[:at] + text[text.index(end, at) + len(end) :]
    if path.name not in TIMING_KEYS:
        return read_bytes(path, "faults", cap=None)
    data = read_json(path, "faults", cap=None)
    for keys in TIMING_KEYS[path.name]:
        holder = data
        for key in keys[:-1]:
            holder = holder.get(key) if isinstance(holder, dict) else None
        if isinstance(holder, dict):
            holder.pop(keys[-1], None)
    return data


def _without_section(text: bytes, heading: bytes) -> bytes:
    """Markdown ``text`` with the section under ``heading`` (to the next heading of its level) left out."""
    lines = text.split(b"\n")
    if heading not in lines:
        return text
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(b"## ")), len(lines))
    return b"\n".join(lines[:start] + lines[end:])


def whole_safetensors(path: Path) -> str:
    """ "" when ``path`` is a complete safetensors file (header and every tensor's bytes present), else why not."""
    from surgery.files.gate import read_bytes

    data = read_bytes(path, "faults", cap=None)
    if len(data) < 8:
        return "shorter than a safetensors header"
    length = struct.unpack("<Q", data[:8])[0]
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError:
        return "its header does not parse"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    if 8 + length + max(ends, default=0) != len(data):
        return f"{len(data)} bytes where its header promises {8 + length + max(ends, default=0)}"
    return ""


def differences(reference: dict[str, Path], found: dict[str, Path]) -> list[str]:
    """What differs between a finished run and the reference, one line each."""
    problems = [f"missing {name}" for name in sorted(set(reference) - set(found))]
    problems += [f"extra file {name}" for name in sorted(set(found) - set(reference))]
    problems += [f"{name} differs" for name in sorted(set(reference) & set(found))
                 if content(reference[name]) != content(found[name])]  # fmt: skip
    return problems


def killed_problems(reference: dict[str, Path], run: Path) -> tuple[list[str], int]:
    """What is wrong with a killed run's folder (before the rerun), and how many temporary files it holds."""
    problems: list[str] = []
    temporary = 0
    for name, path in files_of(run).items():
        if TEMPORARY.match(path.name):
            temporary += 1
            continue
        if path.suffix == ".safetensors" and (why := whole_safetensors(path)):
            problems.append(f"{name} is half written ({why})")
            continue
        if path.suffix == ".json":
            try:
                content(path)
            except Exception as e:  # noqa: BLE001 - any failure to parse is the finding
                problems.append(f"{name} does not parse ({e})")
                continue
        if path.name in PROGRESSIVE:
            continue
        if path.name == "manifest.json" and not content(path).get("complete"):
            continue  # an unfinished harvest's manifest: rewritten when it finishes
        if name not in reference:
            problems.append(f"{name} is not a file a finished run has")
        elif content(path) != content(reference[name]):
            problems.append(f"{name} exists, finished, but differs from the reference")
    return problems + reader_problems(reference, run), temporary


def reader_problems(reference: dict[str, Path], run: Path) -> list[str]:
    """The readers on a killed folder: one-line refusals or the reference's data, never a half file as finished."""
    from surgery.errors import SurgeryError

    problems: list[str] = []
    if (run / "activations").exists():
        import surgery.activations

        try:
            data = surgery.activations.open(run / "activations", by="row")
        except SurgeryError as e:
            if "\n" in str(e):
                problems.append(f"activations.open refused in more than one line: {e}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"activations.open failed: {type(e).__name__}: {e}")
        else:
            problems += _same_dataset(data, run, reference)
    if (run / "multirun.yaml").is_file() or (run / "0").is_dir():  # a sweep's folder
        from surgery.app.sweep import collect

        try:
            for job in collect(run):
                if job["report"] is not None and not isinstance(job["report"], dict):
                    problems.append(f"sweep job {job['job']}: a report that is not an object")
        except SurgeryError:
            pass
        except Exception as e:  # noqa: BLE001
            problems.append(f"sweep collect failed: {type(e).__name__}: {e}")
    return problems


def _same_dataset(data: Any, run: Path, reference: dict[str, Path]) -> list[str]:
    """A dataset a killed harvest's folder opens as must be the reference's, item for item."""
    import torch

    import surgery.activations

    base = reference["activations/manifest.json"].parent
    whole = surgery.activations.open(base, by="row")
    if len(data) != len(whole):
        return [f"activations.open read {len(data)} rows of a killed harvest, the finished one has {len(whole)}"]
    for index in range(len(whole)):
        got, want = data[index], whole[index]
        if any(not torch.equal(got[k], want[k]) for k in want):
            return [f"activations.open read row {index} of a killed harvest unlike the finished one"]
    return []


# ---------------------------------------------------------------- trials


@dataclass
class Tally:
    """One kind's outcome."""

    kind: str
    kills: int = 0  # kill attempts (a trial killed twice counts two)
    landed: int = 0  # of those, while the job still ran
    trials: int = 0
    identical: int = 0  # trials whose completed rerun equals the reference
    temporary_left: int = 0  # temporary files found after a kill (the rerun must remove them)
    failures: list[str] = field(default_factory=list)


def reference_of(kind: Kind, root: Path, references: int = 2) -> tuple[dict[str, Path], float, list[str]]:
    """The uninterrupted run's files and duration; with two references, what differs between them too."""
    folder = root / kind.name / "reference"
    seconds, error = run_to_end(kind, root, folder)
    if error:
        raise RuntimeError(f"{kind.name}: the uninterrupted run failed: {error}")
    reference = files_of(folder / "run")
    problems: list[str] = []
    if references > 1:
        again = root / kind.name / "reference-again"
        more, error = run_to_end(kind, root, again)
        if error:
            raise RuntimeError(f"{kind.name}: the second uninterrupted run failed: {error}")
        problems = [f"two uninterrupted runs differ: {p}" for p in differences(reference, files_of(again / "run"))]
        seconds = max(seconds, more)
    return reference, seconds, problems


REDRAWS = 4  # a trial's kill is drawn again (over the time the job took) until it lands, this many times at most


def trial(kind: Kind, root: Path, reference: dict[str, Path], duration: float, rng: random.Random, number: int,
          tally: Tally, keep: bool = False, times: int | None = None) -> None:  # fmt: skip
    """Kill the job once or twice (``times``) at random moments, rerun it to the end, compare; failures in ``tally``."""
    from surgery.files.gate import remove_tree

    folder = root / kind.name / f"trial-{number:04d}"
    remove_tree(folder)
    twice = rng.random() < 0.25
    kills = times or (2 if twice else 1)
    problems: list[str] = []
    for k in range(kills):
        delay, span = rng.uniform(0.0, duration), duration
        # A first kill after the job finished tests nothing: the folder is emptied and the kill drawn again over the
        # time the job took (a second kill may come after the resumed run finished: that is a rerun, compared too).
        for _ in range(REDRAWS if k == 0 else 1):
            tally.kills += 1
            finished = run_and_kill(kind, root, folder, delay)
            if finished is None:
                tally.landed += 1
                break
            if k == 0:
                remove_tree(folder)
                span = min(span, finished)
                delay = rng.uniform(0.0, span)
        found, temporary = killed_problems(reference, folder / "run")
        tally.temporary_left += temporary
        problems += [f"after kill {k + 1} at {delay:.2f} s: {p}" for p in found]
    _, error = run_to_end(kind, root, folder)
    if error:
        problems.append(f"the rerun failed: {error}")
    else:
        problems += [f"after the rerun: {p}" for p in differences(reference, files_of(folder / "run"))]
    tally.trials += 1
    if problems:
        tally.failures += [f"{kind.name} trial {number}: {p}" for p in problems]
    else:
        tally.identical += 1
        if not keep:
            remove_tree(folder)


def run_kind(kind: Kind, root: Path, trials: int, seed: int, references: int = 2, keep: bool = False,
             say: Callable[[str], None] = print, times: int | None = None) -> Tally:  # fmt: skip
    """The reference, then ``trials`` trials of ``kind`` (seeded), each killed ``times`` (default: once or twice)."""
    kind.setup(root)
    reference, duration, problems = reference_of(kind, root, references)
    say(f"{kind.name}: reference {len(reference)} files in {duration:.1f} s")
    tally = Tally(kind.name, failures=problems)
    rng = random.Random(f"{seed}-{kind.name}")
    for number in range(trials):
        trial(kind, root, reference, duration, rng, number, tally, keep, times)
        if (number + 1) % 10 == 0 or number + 1 == trials:
            say(f"{kind.name}: {number + 1} trials, {tally.identical} identical, {len(tally.failures)} failures")
    return tally


def table(tallies: list[Tally]) -> str:
    """The summary: kind, kills (landed while running), trials, identical reruns, temporary files seen, failures."""
    lines = [f"{'kind':8} {'kills':>6} {'landed':>7} {'trials':>7} {'identical':>10} {'tmp seen':>9} {'failures':>9}"]
    for t in tallies:
        lines.append(f"{t.kind:8} {t.kills:6d} {t.landed:7d} {t.trials:7d} {t.identical:10d} {t.temporary_left:9d}"
                     f" {len(t.failures):9d}")  # fmt: skip
    return "\n".join(lines)
