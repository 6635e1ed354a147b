"""A recipe inside Lightning training: ``Trainer(callbacks=[SurgeryCallback("clip_grads")])``.

The recipe is planned and applied in ``setup`` of its stage: errors (a selector that matches nothing, a
bad key) stop the run before the first step, and parameters added by ``add_parameter`` exist when
Lightning calls ``configure_optimizers`` and wraps the module for DDP (both come after ``setup``), so
``self.parameters()`` there includes them. It is removed in ``teardown`` of the stage (checking every
hook, module and tensor slot is back) and on an exception. Statistics of captures and captured
gradients go through ``pl_module.log`` every ``log_every_n_steps`` batches (see
``surgery.integrations.training`` for what each value is), so every Lightning logger receives them.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from surgery.core.engine import Surgery
from surgery.errors import ConfigError
from surgery.integrations.training import STAGES, TrainingSurgery, check_log_every

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("surgery.integrations.lightning needs Lightning: pip install 'surgery[lightning]'") from e


class SurgeryCallback(Callback):
    """Apply ``actions`` (whatever ``surgery.plan`` accepts) for one Lightning stage and log its captures.

    >>> trainer = Trainer(callbacks=[SurgeryCallback("clip_grads", log_every_n_steps=50)])
    """

    def __init__(self, actions: Any, stage: str = "fit", log_every_n_steps: int = 50, save_added: Any = None) -> None:
        if stage not in STAGES:
            raise ConfigError(
                f"SurgeryCallback.stage: {stage!r} is not a Lightning stage; use one of {', '.join(STAGES)}"
            )
        self.stage = stage
        self.log_every_n_steps = check_log_every(log_every_n_steps, "SurgeryCallback")
        self._run = TrainingSurgery(actions, "SurgeryCallback", save_added)  # written at teardown and on_exception
        self._trainer: Trainer | None = None
        self._batches = 0
        self._state_key: str | None = None

    @property
    def state_key(self) -> str:
        """Two SurgeryCallbacks with different recipes may share a Trainer.

        Made once: Lightning reads it around every callback hook it calls (over a hundred times a fit).
        """
        if self._state_key is None:
            self._state_key = self._generate_state_key(actions=repr(self._run.actions), stage=self.stage)
        return self._state_key

    @property
    def surgery(self) -> Surgery | None:
        """The applied surgery (its ``captures``), or None outside the stage."""
        return self._run.surgery

    @property
    def added_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters the recipe added (in ``pl_module.parameters()`` while applied)."""
        return list(self._run.added)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Plan and apply against ``pl_module`` before the optimizers and the DDP wrapper exist."""
        if stage != self.stage:
            return
        if self._run.active:
            raise ConfigError(
                "SurgeryCallback: this callback is already applied for another trainer's run; one callback serves one"
                " trainer at a time: make one SurgeryCallback per Trainer"
            )
        self._trainer, self._batches = trainer, 0
        self._run.apply(pl_module)
        every, ours = getattr(trainer, "log_every_n_steps", 0), self.log_every_n_steps  # set by its logger connector
        if ours and every and every % ours:
            warnings.warn(
                f"SurgeryCallback(log_every_n_steps={ours}): Lightning writes step metrics every {every} batches"
                " (Trainer(log_every_n_steps)) and repeats the last value in between; give the callback the same"
                " number or a divisor of it",
                UserWarning,
                stacklevel=2,
            )

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Remove the recipe and check the module is back in every hook, module and tensor slot."""
        if stage == self.stage and trainer is self._trainer:
            self._trainer = None
            self._run.remove(check=True)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Remove the recipe without checking: the error in flight is the one to see."""
        if trainer is self._trainer:
            self._trainer = None
            self._run.remove(check=False)

    def remove(self) -> None:
        """Remove the recipe now (as ``teardown`` would), e.g. after a run stopped outside Lightning's handling."""
        self._trainer = None
        self._run.remove(check=True)

    def _batch_end(self, trainer: Trainer, pl_module: LightningModule, loop: str) -> None:
        if trainer is not self._trainer:
            return
        if (
            loop == self.stage and self.stage != "predict" and self.log_every_n_steps
        ):  # Lightning refuses log in predict
            self._batches += 1
            if self._batches % self.log_every_n_steps == 0:
                for key, value in self._run.statistics().items():
                    pl_module.log(key, value, on_step=True, on_epoch=False)
        self._run.end_step()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Log every ``log_every_n_steps`` training batches; forget kept calls."""
        self._batch_end(trainer, pl_module, "fit")

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """In ``validate``, log as in training; in ``fit``, only forget kept calls."""
        self._batch_end(trainer, pl_module, "validate")

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Log every ``log_every_n_steps`` test batches."""
        self._batch_end(trainer, pl_module, "test")

    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Forget kept calls (Lightning allows no logging in predict)."""
        self._batch_end(trainer, pl_module, "predict")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """In ``fit``, validation batches stay out of the training window's statistics."""
        if self.stage == "fit" and trainer is self._trainer:
            self._run.set_window_aside()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Training's window continues where it was."""
        if self.stage == "fit" and trainer is self._trainer:
            self._run.resume_window()
