"""+study=NAME from the command line's job: one run writes study.safetensors, study.csv, plots and reports
whose numbers equal surgery.study's on the same model and prompts, which tests/test_study.py checks by hand."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import surgery
from surgery.app.job import run_job
from surgery.errors import ConfigError
from surgery.lm.load import load_pretrained
from surgery.lm.text import encode_prompts, load_tokenizer
from tests.test_cli import cli, composed
from tests.test_lm_cli import lm_dir  # noqa: F401 - the saved GPT-2 fixture

CLEAN, CORRUPT = "the cat sat on the", "the dog sat on the"
ARGS = ("+input=text", f"input.prompt={CLEAN!r}".replace("'", ""), "+source=text")
METRICS = "study.metrics=[{logit_diff: {correct: mat, wrong: park}}, kl]"


def args(path: Path, *more: str) -> list[str]:
    return ["+model=hf", f"model.path={path}", "+input=text", f"input.prompt={CORRUPT}", "+source=text",
            f"source.prompt={CLEAN}", "+study=patch_layer_pos", METRICS, *more]  # fmt: skip


def test_a_study_run_writes_the_numbers_surgery_study_gives(lm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    report = run_job(composed(*args(lm_dir, "study.ci=0.9")), tmp_path)
    model, tok = load_pretrained(lm_dir), load_tokenizer(model_path=lm_dir)
    corrupt, clean = encode_prompts(tok, prompts=[CORRUPT]), encode_prompts(tok, prompts=[CLEAN])
    actions = composed("+study=patch_layer_pos").actions
    want = surgery.study(model, actions, {"layer": "0:2", "pos": "all"}, corrupt.kwargs(),
                         [{"logit_diff": {"correct": "mat", "wrong": "park"}}, "kl"], source=clean.kwargs(),
                         tokenizer=tok, ci=0.9)  # fmt: skip
    saved = load_file(tmp_path / "study.safetensors")
    assert torch.equal(saved["values/logit_diff"], want.values["logit_diff"])
    assert torch.equal(saved["ci_high/kl"], want.ci_high["kl"])
    assert saved["values/kl"].shape == (2, 5, 1)
    rows = list(csv.reader((tmp_path / "study.csv").open()))
    assert rows[0] == ["layer", "pos", "metric", "mean", "ci_low", "ci_high"] and len(rows) == 1 + 2 * 5 * 2
    assert float(rows[1][3]) == float(want.mean["logit_diff"][0, 0])
    assert report["study"]["tokens"] == ["the", "dog", "sat", "on", "the"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["study_kl.png", "study_logit_diff.png"]
    assert json.loads((tmp_path / "report.json").read_text())["study"]["cells"] == 10
    assert (tmp_path / "report.md").read_text().index("plots/study_logit_diff.png") < 200  # the plots come first


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (("study.grid.layer=0:5",), "study cell {layer: 2, pos: 0}: actions.study_cap"),
        (("++study.method=atp",), "study.method: 'atp' is not one of patch, attribution, integrated_gradients"),
        (("+study.nope=1",), "study.nope: unknown key"),
        (("study.metrics=[{prob: {token: the cat}}]",), "study.metrics[0].prob.token: 'the cat' is 2 tokens"),
    ],
)
def test_a_bad_study_is_refused_before_any_cell_runs(lm_dir: Path, tmp_path: Path, more, message) -> None:  # noqa: F811
    with pytest.raises(ConfigError) as e:
        run_job(composed(*args(lm_dir, *more)), tmp_path)
    assert str(e.value).startswith(message)
    assert not (tmp_path / "study.safetensors").exists()


def test_the_cli_runs_a_study_and_exits_0(lm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    result = cli(*args(lm_dir), "hydra.run.dir=run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "study: 10 cells × 1 examples (load " in result.stdout and "logit_diff (unmodified " in result.stdout
    times = re.search(r"\(load ([0-9.]+) s, plan ([0-9.]+) s, run ([0-9.]+) s\)", result.stdout)
    assert times, result.stdout  # the study's own time apart from loading (issue 39)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["study"]["seconds"]) == {"load", "plan", "run"}
    assert (tmp_path / "run" / "study.csv").is_file() and (tmp_path / "run" / "plots" / "study_kl.png").is_file()


def test_an_interrupted_study_resumes_computing_only_the_missing_cells(
    lm_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from surgery.study import cells as run

    real, ran = run._run_group, []

    def stopping(*args, **kwargs):
        if len(ran) == 3:
            raise KeyboardInterrupt  # as a second Ctrl-C would stop the job where it is
        ran.append(1)
        return real(*args, **kwargs)

    cfg = composed(*args(lm_dir, "study.batch_cells=1"))
    monkeypatch.setattr(run, "_run_group", stopping)
    with pytest.raises(KeyboardInterrupt):
        run_job(cfg, tmp_path)
    assert (tmp_path / "study.partial.safetensors").is_file() and not (tmp_path / "study.safetensors").exists()
    ran.clear()
    monkeypatch.setattr(run, "_run_group", lambda *a, **k: (ran.append(1), real(*a, **k))[1])
    run_job(cfg, tmp_path)
    assert len(ran) == 10 - 3  # only the cells the interrupted run had not scored
    assert not (tmp_path / "study.partial.safetensors").exists()
    fresh = tmp_path / "fresh"
    run_job(cfg, fresh)
    resumed, whole = load_file(tmp_path / "study.safetensors"), load_file(fresh / "study.safetensors")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_resume_with_another_config_is_refused(lm_dir: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    from surgery.study import cells as run

    real, ran = run._run_group, []

    def stop(*a, **k):
        if ran:
            raise KeyboardInterrupt
        ran.append(1)
        return real(*a, **k)

    monkeypatch.setattr(run, "_run_group", stop)
    with pytest.raises(KeyboardInterrupt):
        run_job(composed(*args(lm_dir, "study.batch_cells=1")), tmp_path)
    monkeypatch.undo()
    from surgery.study import resume

    resume_path = tmp_path / resume.PARTIAL
    assert resume_path.is_file()
    with pytest.raises(ConfigError, match=r"^hydra.run.dir: .* holds an interrupted study of another config"):
        run_job(composed(*args(lm_dir, "study.batch_cells=1", "study.normalize=true")), tmp_path)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_torchrun_ranks_split_the_cells_and_write_the_single_process_result(lm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "ranks"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "surgery",
               *args(lm_dir, "study.batch_cells=1"), f"hydra.run.dir={out}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    single, threads = tmp_path / "single", torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1): the same kernels, so the same bits
    try:
        run_job(composed(*args(lm_dir, "study.batch_cells=1")), single)
    finally:
        torch.set_num_threads(threads)
    ranks, one = load_file(out / "study.safetensors"), load_file(single / "study.safetensors")
    assert all(torch.equal(ranks[k], one[k]) for k in one)
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["data"]["examples"] == 1 and report["study"]["cells"] == 10
    assert (out / "study.csv").read_text() == (single / "study.csv").read_text()


def test_an_attribution_study_from_the_cli_verifies_its_top_cells(lm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    report = run_job(composed(*args(lm_dir, "++study.method=attribution", "++study.verify_top=3")), tmp_path)
    verify = report["study"]["verify"]
    assert report["study"]["method"] == "attribution" and len(verify["exact"]) == 3
    saved = load_file(tmp_path / "study.safetensors")
    assert saved["values/logit_diff"].shape == (2, 5, 1)  # the same files and shapes as an exact study
    assert (tmp_path / "plots" / "study_verify.png").is_file()
    assert json.loads((tmp_path / "report.json").read_text())["study"]["verify"]["cells"] == verify["cells"]


def test_several_prompts_and_source_prompts_make_one_example_each(lm_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    prompts = [
        "+model=hf", f"model.path={lm_dir}", "+input=text", "input.prompts=[the dog sat on the,the cat ran in the]",
        "+source=text", "source.prompts=[the cat sat on the,the dog ran in the]", "+study=patch_layer_pos", METRICS,
    ]  # fmt: skip
    report = run_job(composed(*prompts), tmp_path)  # source.prompt stays ??? beside source.prompts: that is fine
    assert report["study"]["examples"] == 2
    assert load_file(tmp_path / "study.safetensors")["values/kl"].shape == (2, 5, 2)
