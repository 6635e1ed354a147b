"""Recipes inside Lightning and transformers.Trainer runs: each equals the same training written by hand in PyTorch."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from surgery.errors import ConfigError, NoMatchError, SurgeryError  # noqa: E402
from surgery.integrations.lightning import SurgeryCallback  # noqa: E402
from tests.conftest import MODULE_HOOK_ATTRS, TENSOR_HOOK_ATTRS, global_hooks, hook_attr  # noqa: E402

MAX_NORM = 0.05
STEPS = 4
# freeze the first layer, learn an extra output bias, clip the last weight's gradient, watch both
RECIPE: dict[str, Any] = {
    "freeze_first": {"kind": "freeze", "select": "net.0"},
    "add_bias": {"kind": "add_parameter", "select": "net.2", "name": "extra", "shape": [2]},
    "use_bias": {"kind": "modify_output", "select": "net.2", "op": "expr", "expr": "output + module.extra"},
    "clip": {"kind": "modify_grad", "select": "net.2", "param": "weight", "op": "clip_norm", "max_norm": MAX_NORM},
    "grads": {"kind": "capture_grad", "select": "net.2", "param": "weight"},
    "acts": {"kind": "capture", "select": "net.1", "reduce": "stats"},
}


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(4 * STEPS, 4, generator=g), torch.randn(4 * STEPS, 2, generator=g))


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class Regressor(pl.LightningModule):
    """A tiny MLP regressor; notes each step's clipped gradient of the last weight as the optimizer will see it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.grad_norms: list[float] = []
        self.steps = self.validated = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.steps += 1
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated += 1  # its batches pass the capture hooks too; they must stay out of the training window
        self(batch[0] * 3)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grad_norms.append(torch.linalg.vector_norm(self.net[2].weight.grad.double()).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def hooks_of(model: nn.Module) -> dict[str, Any]:
    """Every hook attribute of every module and tensor, the tensor slots, and PyTorch's global hooks."""
    facts: dict[str, Any] = {"<globals>": global_hooks()}
    for path, module in model.named_modules(remove_duplicate=False):
        facts[path] = {name: hook_attr(vars(module).get(name, "<absent>")) for name in MODULE_HOOK_ATTRS}
        facts[path]["slots"] = [(n, id(t)) for n, t in [*module._parameters.items(), *module._buffers.items()]]
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            facts[f"{path}.{name}"] = {a: hook_attr(getattr(tensor, a, "<absent>")) for a in TENSOR_HOOK_ATTRS}
            facts[f"{path}.{name}"]["requires_grad"] = tensor.requires_grad
    return facts


def by_hand() -> dict[str, Any]:
    """The same training in plain PyTorch: frozen layer, extra bias, clipping hook, SGD; what the logs should say."""
    net = make_net()
    net[0].requires_grad_(False)
    extra = nn.Parameter(torch.zeros(2))

    def clip(g: torch.Tensor) -> torch.Tensor:
        return g * (MAX_NORM / (torch.linalg.vector_norm(g) + 1e-6)).clamp(max=1.0)

    net[2].weight.register_hook(clip)
    acts: list[torch.Tensor] = []
    net[1].register_forward_hook(lambda m, a, out: acts.append(out.detach().double()))
    optimizer = torch.optim.SGD([*net.parameters(), extra], lr=0.5)
    grads, windows = [], []
    for step, (x, y) in enumerate(DataLoader(data(), batch_size=4), start=1):
        optimizer.zero_grad()
        F.mse_loss(net(x) + extra, y).backward()
        grads.append(net[2].weight.grad.double())
        optimizer.step()
        if step % 2 == 0:  # the callback's log_every_n_steps
            rows = torch.cat(acts)
            windows.append((rows.mean().item(), rows.std(correction=0).item(), rows.pow(2).sum(1).mean().sqrt().item()))
            acts.clear()
    return {"net": net, "extra": extra, "grads": grads, "windows": windows}


def metrics_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def trainer_for(tmp_path: Path, callback: pl.Callback, **options: Any) -> pl.Trainer:
    logger = CSVLogger(tmp_path, name="run")
    return pl.Trainer(
        max_steps=STEPS, callbacks=[callback], logger=logger, log_every_n_steps=2, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, accelerator="cpu", devices=1, **options,
    )  # fmt: skip


def test_lightning_fit_trains_as_written_by_hand_and_restores_every_hook(tmp_path: Path) -> None:
    model = Regressor()
    before = hooks_of(model)
    frozen = [p.detach().clone() for p in model.net[0].parameters()]
    callback = SurgeryCallback(RECIPE, log_every_n_steps=2)
    trainer = trainer_for(tmp_path, callback)
    trainer.fit(model, DataLoader(data(), batch_size=4), DataLoader(data(), batch_size=8))
    hand = by_hand()
    assert model.validated == 4  # the sanity check's two batches and the epoch's two

    assert hooks_of(model) == before  # no hook, slot or flag of ours left; the extra bias is gone again
    assert all(torch.equal(p, q) for p, q in zip(model.net[0].parameters(), frozen))
    for ours, theirs in zip(model.net.state_dict().values(), hand["net"].state_dict().values()):
        assert torch.equal(ours, theirs)
    (extra,) = callback.added_parameters
    assert torch.equal(extra.detach(), hand["extra"].detach()) and extra.abs().sum() > 0  # learned
    assert model.grad_norms == [g.norm().item() for g in hand["grads"]]
    assert max(model.grad_norms) <= MAX_NORM

    rows = [r for r in metrics_rows(trainer.logger) if r.get("surgery/grads/net.2.weight/norm")]
    assert [int(r["step"]) for r in rows] == [1, 3]
    as_logged = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731 - Lightning logs float32
    for row, grad, window in zip(rows, hand["grads"][1::2], hand["windows"]):
        assert float(row["surgery/grads/net.2.weight/norm"]) == as_logged(grad.norm().item()) <= MAX_NORM
        assert float(row["surgery/grads/net.2.weight/mean"]) == as_logged(grad.mean().item())
        assert float(row["surgery/grads/net.2.weight/std"]) == as_logged(grad.std(correction=0).item())
        logged = [float(row[f"surgery/acts/net.1/{s}"]) for s in ("mean", "std", "norm")]
        assert logged == pytest.approx(window, rel=1e-6)  # pooled (Chan) vs direct, both double, then float32


def test_stage_must_be_a_lightning_stage() -> None:
    with pytest.raises(ConfigError, match=r"SurgeryCallback.stage: 'train' is not a Lightning stage; use one of fit"):
        SurgeryCallback("clip_grads", stage="train")


def test_log_every_n_steps_must_be_a_count() -> None:
    with pytest.raises(ConfigError, match=r"SurgeryCallback.log_every_n_steps: expected a whole number >= 0"):
        SurgeryCallback("clip_grads", log_every_n_steps=-1)


def test_a_recipe_that_does_not_fit_stops_the_run_before_any_step(tmp_path: Path) -> None:
    model = Regressor()
    before = hooks_of(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    recipe = {
        "clip": {"kind": "modify_grad", "select": "encoder.*", "param": "weight", "op": "clip_norm", "max_norm": 1.0}
    }
    trainer = trainer_for(tmp_path, SurgeryCallback(recipe))
    with pytest.raises(NoMatchError, match=r"actions\.clip"):
        trainer.fit(model, DataLoader(data(), batch_size=4))
    assert model.steps == 0 and hooks_of(model) == before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())


def test_one_callback_serves_one_trainer_at_a_time(tmp_path: Path) -> None:
    callback = SurgeryCallback(RECIPE, log_every_n_steps=2)
    first, second = Regressor(), Regressor()
    before = hooks_of(first)
    trainer = trainer_for(tmp_path / "a", callback)
    callback.setup(trainer, first, "fit")  # what the first trainer's fit does; it is still running
    with pytest.raises(ConfigError, match=r"already applied for another trainer's run; .* one SurgeryCallback per"):
        trainer_for(tmp_path / "b", callback).fit(second, DataLoader(data(), batch_size=4))
    assert second.steps == 0
    callback.teardown(trainer, first, "fit")
    assert hooks_of(first) == before


class HFRegressor(nn.Module):
    """The same MLP as a model transformers.Trainer can train: returns its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


def hf_trainer(tmp_path: Path, model: nn.Module, callbacks: list[Any]) -> Any:
    transformers = pytest.importorskip("transformers")
    x, y = data().tensors
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, logging_steps=2,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        train_sampling_strategy="sequential", report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    rows = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    return transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)


def test_trainer_run_trains_as_written_by_hand_and_restores_every_hook(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from surgery.integrations.hf import SurgeryTrainerCallback

    class GradNorms(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module, **kw: Any) -> None:
            self.norms.append(torch.linalg.vector_norm(model.net[2].weight.grad.double()).item())

    model = HFRegressor()
    before = hooks_of(model)
    frozen = [p.detach().clone() for p in model.net[0].parameters()]
    callback, probe = SurgeryTrainerCallback(RECIPE), GradNorms()
    trainer = hf_trainer(tmp_path, model, [callback, probe])
    trainer.train()
    hand = by_hand()

    assert hooks_of(model) == before
    assert all(torch.equal(p, q) for p, q in zip(model.net[0].parameters(), frozen))
    for ours, theirs in zip(model.net.state_dict().values(), hand["net"].state_dict().values()):
        assert torch.equal(ours, theirs)
    (extra,) = callback.added_parameters
    assert torch.equal(extra.detach(), hand["extra"].detach()) and extra.abs().sum() > 0
    assert all(extra is not p for g in trainer.optimizer.param_groups for p in g["params"])  # it left the optimizer
    assert probe.norms == [g.norm().item() for g in hand["grads"]] and max(probe.norms) <= MAX_NORM

    logged = [e for e in trainer.state.log_history if "surgery/grads/net.2.weight/norm" in e]
    assert [e["step"] for e in logged] == [2, 4]
    for entry, grad, window in zip(logged, hand["grads"][1::2], hand["windows"]):
        assert entry["surgery/grads/net.2.weight/norm"] == grad.norm().item() <= MAX_NORM
        assert entry["surgery/grads/net.2.weight/mean"] == grad.mean().item()
        assert [entry[f"surgery/acts/net.1/{s}"] for s in ("mean", "std", "norm")] == pytest.approx(window, rel=1e-12)


def test_trainer_recipe_that_does_not_fit_stops_before_any_step(tmp_path: Path) -> None:
    from surgery.integrations.hf import SurgeryTrainerCallback

    model = HFRegressor()
    before = hooks_of(model)
    recipe = {"acts": {"kind": "capture", "select": "net.9"}}
    trainer = hf_trainer(tmp_path, model, [SurgeryTrainerCallback(recipe)])
    with pytest.raises(SurgeryError, match=r"actions\.acts"):
        trainer.train()
    assert trainer.state.global_step == 0 and hooks_of(model) == before


class DistributedDataParallel(nn.Module):
    """Stands for torch's DDP wrapper (the engine knows it by class name): the model sits under ``module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def test_logged_names_see_through_a_ddp_wrapper() -> None:
    """The same keys and values whether the recipe meets the bare module or one wrapped as DDP wraps it."""
    from surgery.integrations.training import TrainingSurgery

    logged = []
    for wrap in (False, True):
        model = Regressor()
        run = TrainingSurgery(RECIPE, "test")
        run.apply(DistributedDataParallel(model) if wrap else model)
        x, y = data().tensors
        F.mse_loss(model(x[:4]), y[:4]).backward()
        logged.append(run.statistics())
        run.remove()
    assert logged[0] == logged[1] and "surgery/grads/net.2.weight/norm" in logged[1]


DDP_RUN = """
import json, sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from surgery.integrations.lightning import SurgeryCallback
from tests.test_integrations import RECIPE, Regressor, data, hooks_of

model = Regressor()
before, frozen = hooks_of(model), model.net[0].weight.detach().clone()
callback = SurgeryCallback(RECIPE, log_every_n_steps=1)
trainer = pl.Trainer(max_steps=2, strategy="ddp", devices=2, accelerator="cpu", callbacks=[callback],
                     logger=CSVLogger(sys.argv[1], name="run", version=0), log_every_n_steps=1,
                     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
trainer.fit(model, DataLoader(data(), batch_size=4))
(extra,) = callback.added_parameters
result = {"restored": hooks_of(model) == before, "frozen": torch.equal(frozen, model.net[0].weight),
          "extra": extra.tolist()}
json.dump(result, open(f"{sys.argv[1]}/rank{trainer.global_rank}.json", "w"))
"""


@pytest.mark.skipif(
    not os.environ.get("SURGERY_DDP_TEST"),
    reason="two gloo processes take ~1 min on a loaded 2-core machine; SURGERY_DDP_TEST=1 runs it",
)
def test_lightning_ddp_two_processes(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_RUN)
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=root, env=env, check=True, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["restored"] and r["frozen"] for r in ranks)
    assert ranks[0]["extra"] == ranks[1]["extra"] and any(ranks[0]["extra"])  # in DDP's buckets: kept in sync
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        norms = [float(r["surgery/grads/net.2.weight/norm"]) for r in csv.DictReader(f)]
    assert len(norms) == 2 and max(norms) <= MAX_NORM


def test_the_documented_hydra_callbacks_entry_instantiates() -> None:
    """docs/training.md's callbacks entries, as lightning-hydra-template's train.py instantiates them."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    by_name = instantiate(
        OmegaConf.create(
            "surgery:\n  _target_: surgery.integrations.lightning.SurgeryCallback\n  actions: clip_grads\n"
            "  stage: fit\n  log_every_n_steps: 2\n"
        )
    )["surgery"]
    inline = instantiate(
        OmegaConf.create(
            "_target_: surgery.integrations.lightning.SurgeryCallback\n_recursive_: false\nactions:\n"
            "  watch: {kind: capture, type: ReLU, reduce: stats}\n"
            "  gelu: {kind: replace_module, type: ReLU, with: {_target_: torch.nn.GELU}}\n"
        )
    )
    for callback in (by_name, inline):
        assert isinstance(callback, SurgeryCallback)
    assert by_name.log_every_n_steps == 2
    model = Regressor()
    run = inline._run
    run.apply(model)
    assert type(model.net[1]).__name__ == "GELU"  # built by surgery from the recipe, not by Hydra beforehand
    run.remove()
    assert type(model.net[1]).__name__ == "ReLU"


def test_test_stage_logs_each_batch_and_leaves_fit_alone(tmp_path: Path) -> None:
    model = Regressor()
    before = hooks_of(model)
    callback = SurgeryCallback({"out": {"kind": "capture", "select": "net.2"}}, stage="test", log_every_n_steps=1)
    trainer = trainer_for(tmp_path, callback)
    trainer.fit(model, DataLoader(data(), batch_size=4))
    assert callback.surgery is None  # a test-stage recipe is not applied while fitting
    trainer.test(model, DataLoader(data(), batch_size=8))
    assert hooks_of(model) == before
    with torch.no_grad():
        outputs = [model(x).double() for x, _ in DataLoader(data(), batch_size=8)]
    rows = [r for r in metrics_rows(trainer.logger) if r.get("surgery/out/net.2/norm")]
    as_logged = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731
    assert [float(r["surgery/out/net.2/norm"]) for r in rows] == [as_logged(o.norm().item()) for o in outputs]


def test_trainer_refuses_added_parameters_across_processes() -> None:
    """Several processes: the Trainer wrapped the model before on_train_begin, so added parameters would drift."""
    transformers = pytest.importorskip("transformers")
    from surgery.integrations.hf import SurgeryTrainerCallback

    model = HFRegressor()
    before = hooks_of(model)
    args = type("Args", (), {"world_size": 2})()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    callback = SurgeryTrainerCallback(RECIPE)
    with pytest.raises(ConfigError, match=r"actions \['add_bias'\] add parameters, but the Trainer wrapped the model"):
        callback.on_train_begin(
            args, transformers.TrainerState(), transformers.TrainerControl(), model=model, optimizer=optimizer
        )
    assert hooks_of(model) == before and callback.surgery is not None and not callback.surgery.active


def test_state_key_is_made_once_and_names_the_recipe_and_stage() -> None:
    from surgery.integrations.lightning import SurgeryCallback

    a, b = SurgeryCallback({"f": {"kind": "freeze", "select": "net.0"}}), SurgeryCallback("clip_grads", stage="test")
    assert a.state_key is a.state_key  # Lightning reads it around every callback hook: one string, not one a call
    assert a.state_key != b.state_key and "clip_grads" in b.state_key and "'test'" in b.state_key
