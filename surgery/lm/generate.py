"""Generation under a surgery and without it: both continuations of the same prompts, and where they part.

What hooks see during ``generate``: every forward call fires them. With the key/value cache (the
default here) the first call is the prompt pass (the whole prompt, ``[batch, prompt_len, ...]``) and
each later call feeds one new token (``[batch, 1, ...]``), so a module is called once per generated
token, ``max_new_tokens`` times when nothing stops early; call 0 is the prompt pass. Without the cache
every call runs the whole sequence so far. An action therefore acts on the prompt pass and on every
generated token alike, and a capture records one call per forward call (``record.calls``); the
``calls:`` key (see SPEC §9) will choose which calls an action acts on, e.g. ``calls: "1:"`` to leave
the prompt pass alone. The unmodified continuation runs with the surgery paused (hooks off, nothing
captured), or on a copy of the model kept before applying when the plan changes weights or modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from surgery.core.compiler import Plan, compile_plan
from surgery.core.engine import Surgery, apply_plan
from surgery.core.limits import check_count
from surgery.core.records import Record
from surgery.data.evaluate import reference_model
from surgery.errors import ActionError, ConfigError
from surgery.lm.seq2seq import is_encoder_decoder, with_decoder_prompt
from surgery.lm.text import TextBatch, pad_id


@dataclass(frozen=True)
class Generations:
    """Both continuations of each prompt: new token ids, their text (with a tokenizer), where they first differ."""

    prompts: tuple[str, ...]
    surgered: tuple[tuple[int, ...], ...]  # per prompt, new tokens up to and including the first end-of-text
    unmodified: tuple[tuple[int, ...], ...]
    first_difference: tuple[int | None, ...]  # index into the new tokens; None when both are the same
    surgered_text: tuple[str, ...] | None = None
    unmodified_text: tuple[str, ...] | None = None
    captures: dict[str, dict[str, Record]] = field(default_factory=dict)  # what the surgered generation captured

    def to_dict(self) -> dict[str, Any]:
        """One entry per prompt, as report.json holds it."""
        rows = []
        for i, prompt in enumerate(self.prompts):
            row: dict[str, Any] = {"prompt": prompt}
            if self.surgered_text is not None and self.unmodified_text is not None:
                row.update(surgered=self.surgered_text[i], unmodified=self.unmodified_text[i])
            row.update(
                surgered_tokens=list(self.surgered[i]),
                unmodified_tokens=list(self.unmodified[i]),
                first_difference=self.first_difference[i],
            )
            rows.append(row)
        return {"prompts": rows}


def check_can_generate(model: nn.Module, where: str = "mode") -> None:
    """Refuse a model without a language-model head that ``generate`` can drive."""
    can = getattr(type(model), "can_generate", None)
    if not callable(getattr(model, "generate", None)) or (callable(can) and not can()):
        raise ConfigError(
            f"{where}: generate needs a model that generates text (a causal LM with a head, such as GPT2LMHeadModel,"
            f" loaded with AutoModelForCausalLM); {type(model).__name__} cannot generate. Use model.task=causal_lm"
            " on a causal LM directory, or mode=run"
        )


def generate_both(
    model: nn.Module,
    surgery_or_plan: Any,
    batch: TextBatch,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    *,
    tokenizer: Any = None,
    seed: int = 0,
    use_cache: bool = True,
    **plan_options: Any,
) -> Generations:
    """Continue ``batch`` with the surgery and without it; decoded too when ``tokenizer`` is given.

    ``surgery_or_plan``: an applied ``Surgery`` (left applied; hook-only, since its unmodified run pauses
    it), or a ``Plan`` or actions, applied here and removed again (a copy of the model is kept first when
    the plan changes weights or modules). ``do_sample=True`` samples both runs from the same ``seed``.

    >>> out = generate_both(model, {"z": {"kind": "modify_output", "select": "transformer.h.0.mlp", "op": "zero"}},
    ...                     encode_prompts(tok, prompt="The cat sat on the"), max_new_tokens=8, tokenizer=tok)
    >>> out.surgered_text, out.unmodified_text, out.first_difference
    """
    check_can_generate(model)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"generate.max_new_tokens: a positive int, got {max_new_tokens!r}")
    check_count(max_new_tokens, "generate.max_new_tokens", "new tokens")
    if is_encoder_decoder(model) and batch.decoder_input_ids is None:  # T5: the decoder starts from its start token
        batch = with_decoder_prompt(batch, model)
    _check_positions(model, int(batch.input_ids.shape[-1]), max_new_tokens)
    options: dict[str, Any] = {
        **batch.kwargs(),
        "max_new_tokens": max_new_tokens,
        "do_sample": bool(do_sample),
        "use_cache": use_cache,
        "pad_token_id": pad_id(tokenizer) if tokenizer is not None else _model_pad_id(model),
    }
    if isinstance(surgery_or_plan, Surgery):
        surgery = surgery_or_plan
        if surgery.model is not model:
            raise ActionError("generate_both: this surgery was applied to another model")
        _refuse_weight_changes(surgery.plan)
        with _capture_budget(surgery.plan):
            after = _generate(model, options, seed)
        with surgery.paused():
            before = _generate(model, options, seed)
    else:
        plan = (
            surgery_or_plan
            if isinstance(surgery_or_plan, Plan)
            else compile_plan(model, surgery_or_plan, **plan_options)
        )
        reference = reference_model(model, plan)
        surgery = apply_plan(model, plan)
        try:
            with _capture_budget(plan):
                after = _generate(model, options, seed)
            if reference is None:
                with surgery.paused():
                    before = _generate(model, options, seed)
        finally:
            surgery.remove()
        if reference is not None:
            before = _generate(reference, options, seed)
    # the new tokens follow what the generating stack was given: the (left-padded) prompt for a decoder-only
    # model, the decoder prompt for an encoder-decoder one (its output never holds the encoder's prompt)
    prompt_len = (batch.input_ids if batch.decoder_input_ids is None else batch.decoder_input_ids).shape[1]
    stops = _stop_ids(model)
    surgered = tuple(_trim(row[prompt_len:].tolist(), stops) for row in after)
    unmodified = tuple(_trim(row[prompt_len:].tolist(), stops) for row in before)
    texts: tuple[tuple[str, ...] | None, tuple[str, ...] | None] = None, None
    if tokenizer is not None:
        texts = tuple(_decode(tokenizer, ids) for ids in surgered), tuple(_decode(tokenizer, ids) for ids in unmodified)
    return Generations(
        prompts=batch.prompts,
        surgered=surgered,
        unmodified=unmodified,
        first_difference=tuple(first_difference(a, b) for a, b in zip(surgered, unmodified)),
        surgered_text=texts[0],
        unmodified_text=texts[1],
        captures=surgery.captures,
    )


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (a shorter one differs where it ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@contextlib.contextmanager
def _capture_budget(plan: Plan) -> Iterator[None]:
    """Each capture's ``max_bytes`` over the whole generation: every forward call adds what it records.

    The plan's probe saw the prompt pass only; generating calls each module once more per new token,
    so the bytes recorded are counted as they come and the run stops the first time one passes the bound.
    """
    sized = [
        s
        for s in plan.steps
        if s.enabled and s.traits.sized and getattr(s.config, "max_bytes", None) is not None
        and s.config.reduce == "none" and getattr(s.config, "keep", "all") == "all"
    ]  # fmt: skip
    held = dict.fromkeys((s.name for s in sized), 0)
    handles = [
        target.module.register_forward_hook(partial(_count_capture, held, step), with_kwargs=True)
        for step in sized
        for target in step.targets
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _count_capture(held: dict[str, int], step: Any, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    want = step.config.what
    found = (list(args) + list(kwargs.values()) if "input" in want else []) + ([output] if "output" in want else [])
    held[step.name] += sum(t.nbytes for t in _tensors(found))
    if held[step.name] > step.config.max_bytes:
        raise ConfigError(
            f"actions.{step.name}.max_bytes: under mode=generate the capture holds more than"
            f" max_bytes={step.config.max_bytes} (every new token is another call); lower generate.max_new_tokens,"
            " use reduce: mean|stats or keep: last, or select fewer modules"
        )


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [t for v in items for t in _tensors(v)]


def _check_positions(model: nn.Module, prompt: int, new: int) -> None:
    """A model with learned absolute positions (GPT-2's ``n_positions``) cannot go past them: an IndexError inside."""
    positions = getattr(getattr(model, "config", None), "n_positions", None)
    if isinstance(positions, int) and prompt + new > positions:
        raise ConfigError(
            f"generate.max_new_tokens: {new:,} new tokens after a {prompt}-token prompt pass the model's {positions}"
            f" positions (n_positions); at most {max(positions - prompt, 0)} here"
        )


def _generate(model: nn.Module, options: dict[str, Any], seed: int) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)  # both runs sample from the same stream when do_sample is on
        out = model.generate(**options)  # type: ignore[operator]
    return out if isinstance(out, torch.Tensor) else out.sequences


def _refuse_weight_changes(plan: Plan) -> None:
    changing = [s.name for s in plan.steps if s.enabled and s.mechanism == "apply pass"]
    if changing:
        raise ActionError(
            f"generate_both: actions {', '.join(changing)} change weights or modules, so pausing the applied"
            " surgery cannot show the unmodified model; pass the plan (or the actions) instead, and a copy of"
            " the unmodified model is kept before applying"
        )


def _model_pad_id(model: nn.Module) -> int:
    config = getattr(model, "generation_config", None)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            return value
    return 0


def _stop_ids(model: nn.Module) -> set[int]:
    value = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _trim(ids: list[int], stops: set[int]) -> tuple[int, ...]:
    """New tokens up to and including the first end-of-text (what follows is padding)."""
    for i, token in enumerate(ids):
        if token in stops:
            return tuple(ids[: i + 1])
    return tuple(ids)


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))
