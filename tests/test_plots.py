"""Plots of captured tensors and the human report: valid, non-blank PNGs and a readable report.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import surgery
from surgery.app.job import run_job
from surgery.app.plots import plot_records, plot_tensor, safe_file_name
from surgery.core.paths import config_dir
from surgery.report import write_report_md
from tests.conftest import TinyNet, run_both

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_picture(path: Path) -> None:
    """A real PNG with something drawn on it, and no temp file left next to it."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = torch.from_numpy(matplotlib.image.imread(str(path)))
    assert pixels.dim() == 3 and pixels[..., :3].var() > 1e-3  # not a blank canvas
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("shape", "kind"),
    [((2, 16, 7, 7), "maps"), ((8, 5, 5), "maps"), ((4, 10), "histogram"), ((3, 6, 1, 1), "histogram")],
)
def test_plot_tensor_writes_a_picture(tmp_path: Path, shape: tuple[int, ...], kind: str) -> None:
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    path = plot_tensor(tensor, f"cap · <root> · {kind}", tmp_path / "plots" / "x.png")
    assert path == tmp_path / "plots" / "x.png"
    assert_picture(path)


@pytest.mark.parametrize(
    "tensor",
    [torch.tensor(2.0), torch.zeros(0, 3), torch.zeros(0, 4, 5, 5), torch.tensor([1.0, float("nan")]),
     torch.randint(0, 5, (3, 7)), torch.randn(2, 3, 4, 4, dtype=torch.bfloat16), torch.randn(40, 3, 5),
     torch.randn(1, 2, 600, 300)],
)  # fmt: skip
def test_odd_tensors_still_give_a_picture(tmp_path: Path, tensor: torch.Tensor) -> None:
    assert_picture(plot_tensor(tensor, "odd", tmp_path / "odd.png"))


def test_a_failed_plot_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    def broken(self: Figure, *args: object, **kwargs: object) -> None:
        Path(args[0]).write_bytes(b"half")  # type: ignore[arg-type]
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        plot_tensor(torch.randn(4, 10), "t", tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        (("capture", "block3", "output"), "capture__block3__output"),
        (("cap", "<root>", "input.0"), "cap___root___input.0"),
        (("cap", "encoder/layer.0", "grad"), "cap__encoder_layer.0__grad"),
        (("cap", "blöck_é", "output"), "cap__block_e__output"),
        (("cap", "层", "output"), "cap_____output"),
        ((".hidden", "x"), "_hidden__x"),
        (("",), "_"),
        ((), "_"),
    ],
)
def test_safe_file_name(parts: tuple[str, ...], expected: str) -> None:
    assert safe_file_name(*parts) == expected


def test_a_long_name_is_cut_with_a_hash_of_the_whole() -> None:
    a, b = safe_file_name("cap", "x" * 300, "output"), safe_file_name("cap", "x" * 300, "input.0")
    assert len(a) == len(b) == 120 and a != b
    assert a.startswith("cap__xxx") and a == safe_file_name("cap", "x" * 300, "output")


def test_plot_records_plots_the_last_call_of_the_plot_actions_only(tmp_path: Path, tiny: TinyNet) -> None:
    actions = {
        "maps": {"kind": "capture", "select": "conv", "what": ["input", "output"]},
        "grads": {"kind": "capture_grad", "select": "fc"},
        "weight": {"kind": "capture_grad", "select": "fc", "param": "weight"},
        "quiet": {"kind": "capture", "select": "fc"},
    }
    with surgery.apply(tiny, actions) as s:
        run_both(tiny, torch.randn(2, 1, 6, 6))
        run_both(tiny, torch.randn(2, 1, 6, 6))
        paths = plot_records(s.captures, {"maps", "grads", "weight"}, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == [
        "grads__fc__grad_input.0.png", "grads__fc__grad_output.0.png",
        "maps__conv__input.0.png", "maps__conv__output.png", "weight__fc.weight__grad.png",
    ]  # fmt: skip
    assert all(p.parent == tmp_path / "plots" for p in paths)
    for p in paths:
        assert_picture(p)


@pytest.mark.parametrize("module", ["surgery/app/plots.py", "surgery/report/markdown.py", "surgery/app/digit.py"])
def test_matplotlib_is_imported_inside_functions_only(module: str) -> None:
    tree = ast.parse((Path(__file__).resolve().parents[1] / module).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("matplotlib")]


# ---------------------------------------------------------------- report.md


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_report_md_of_a_full_run(tmp_path: Path) -> None:
    cfg = composed(
        "+model=cnn", "+input=random", "+actions=[linearize,capture_block3]", "+actions.capture_block3.plot=true",
        "backward=true",
    )  # fmt: skip
    report = run_job(cfg, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# surgery run: CNN — linearize, capture_block3")
    assert "model restored exactly: **yes**" in text
    assert "| `linearize` | replace_forward | forward hook | 3 | 3: `block1.act`, `block2.act`, `block3.act` |" in text
    assert "| input | `[2, 1, 28, 28]` | float32 |" in text
    assert f"{report['difference']['max_abs']:.4g}" in text and "KL(original ‖ surgered)" in text
    assert "2 captured tensor(s) in `captures.safetensors`" in text and "`capture_block3/block3/output`" in text
    for image in ("capture_block3__block3__input.0.png", "capture_block3__block3__output.png"):
        assert f"](plots/{image})" in text
        assert_picture(tmp_path / "plots" / image)
    assert f"`{report['fingerprints']['output'][:12]}`" in text
    assert report["fingerprints"]["output"] not in text  # short hashes only

    # the same report written again, from absolute image paths, gives the same page
    again = tmp_path / "again"
    write_report_md(report, again, [tmp_path / p for p in report["plots"]])
    assert "](../plots/capture_block3__block3__output.png)" in (again / "report.md").read_text()


def test_report_md_of_a_plan_only_run(tmp_path: Path) -> None:
    report = run_job(composed("+model=cnn", "+actions=linearize", "mode=plan"), tmp_path)
    path = write_report_md(report, tmp_path, [])
    text = path.read_text()
    assert text.startswith("# surgery plan — linearize")
    assert "## Plan" in text and "`block3.act`" in text and "## Fingerprints" in text
    for absent in ("## Difference", "## Plots", "## Input and output", "restored"):
        assert absent not in text
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_report_md_survives_a_sparse_report(tmp_path: Path) -> None:
    plan = [{"action": f"a{i}", "kind": "capture", "matched": [f"m{j}" for j in range(9)]} for i in range(8)]
    report = {"plan": plan, "difference": {"comparable": False, "reason": "shapes differ"}, "restored": False}
    text = write_report_md(report, tmp_path, []).read_text()
    assert "…" in text and "(+5 more)" in text and "(+2 more)" in text
    assert "Not comparable: shapes differ." in text and "**no**" in text
