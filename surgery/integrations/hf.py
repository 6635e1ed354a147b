"""A recipe inside ``transformers.Trainer``: ``Trainer(..., callbacks=[SurgeryTrainerCallback("clip_grads")])``.

Applied in ``on_train_begin`` (a recipe that does not fit raises there, before the first step), removed in
``on_train_end`` (checking every hook, module and tensor slot is back). The Trainer builds its optimizer and
LR scheduler before ``on_train_begin``, so parameters added by ``add_parameter`` join an existing parameter
group (the first without weight decay, else the first; a new group would break the scheduler) and leave it
at the end. Statistics (see ``surgery.integrations.training``) are computed on the steps the Trainer logs
(``logging_steps``) and added to that ``logs`` dict and to ``state.log_history``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from surgery.core.engine import Surgery
from surgery.errors import ConfigError
from surgery.integrations.training import TrainingSurgery

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("surgery.integrations.hf needs transformers: pip install 'surgery[train-hf]'") from e


class SurgeryTrainerCallback(TrainerCallback):
    """Apply ``actions`` (whatever ``surgery.plan`` accepts) for each ``Trainer.train()`` and log its captures.

    >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[SurgeryTrainerCallback("clip_grads")])
    """

    def __init__(self, actions: Any, save_added: Any = None) -> None:
        self._run = TrainingSurgery(actions, "SurgeryTrainerCallback", save_added)  # written by remove()
        self._pending: dict[str, float] = {}
        self._joined: list[tuple[dict[str, Any], nn.Parameter]] = []  # (param group, parameter) we put there
        self._optimizer: torch.optim.Optimizer | None = None

    @property
    def surgery(self) -> Surgery | None:
        """The applied surgery (its ``captures``), or None outside ``train()``."""
        return self._run.surgery

    @property
    def added_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters the recipe added."""
        return list(self._run.added)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Plan and apply against the Trainer's model; hand added parameters to its optimizer."""
        self.remove()  # a train() that raised (the Trainer has no exception event) left the last one applied
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if not isinstance(model, nn.Module):
            raise ConfigError("SurgeryTrainerCallback: the Trainer passed no model to on_train_begin")
        self._run.apply(model)
        if self._run.added:
            try:
                self._join(optimizer, args)
            except BaseException:
                self._run.remove(check=False)
                raise

    def _join(self, optimizer: Any, args: TrainingArguments) -> None:
        assert self._run.surgery is not None
        names = [step.name for step in self._run.surgery.plan.steps if step.kind == "add_parameter"]
        if args.world_size > 1:
            raise ConfigError(
                f"SurgeryTrainerCallback: actions {names} add parameters, but the Trainer wrapped the model for"
                f" {args.world_size} processes before on_train_begin, so they would not be synchronised; apply the"
                " recipe with surgery.apply(model, ...) before building the Trainer"
            )
        if optimizer is None or not getattr(optimizer, "param_groups", None):
            raise ConfigError(
                f"SurgeryTrainerCallback: actions {names} add parameters, but the Trainer has no optimizer"
            )
        groups = optimizer.param_groups
        group = next((g for g in groups if g.get("weight_decay", 0.0) == 0.0), groups[0])
        for parameter in self._run.added:
            group["params"].append(parameter)
            self._joined.append((group, parameter))
        self._optimizer = optimizer

    def _leave(self) -> None:
        state = getattr(self._optimizer, "state", {})
        for group, parameter in self._joined:
            group["params"][:] = [p for p in group["params"] if p is not parameter]
            state.pop(parameter, None)
        self._joined, self._optimizer = [], None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """On a step the Trainer will log, compute the statistics; forget kept calls."""
        if control.should_log and self._run.active:
            self._pending = self._run.statistics()
        self._run.end_step()

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Evaluation inside train(): forget kept calls after each batch."""
        self._run.end_step()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """Add the statistics to the Trainer's logs (and to the entry it just put in ``state.log_history``)."""
        if not self._pending:
            return
        if logs is not None:
            logs.update(self._pending)
        if state.log_history:
            state.log_history[-1].update(self._pending)
        self._pending = {}

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Remove the recipe, take added parameters out of the optimizer, check the model is back."""
        self.remove()

    def remove(self) -> None:
        """Remove the recipe now (what ``on_train_end`` does); call it when ``train()`` raised."""
        self._pending = {}
        self._leave()
        self._run.remove(check=True)
