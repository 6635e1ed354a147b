"""Where surgery steps into Hydra before the task runs: safe mode's checks and messages in our words.

Hydra has no hook between composing a config and acting on it (building ``hydra.callbacks``,
configuring logging from ``hydra.hydra_logging``), nor for its own error messages, so these wrap
the few Hydra functions involved. Each wrapper refuses with one ``error: ...`` line and exit 2; a sweep
job that failed in another process (submitit) exits 2 with its own error line, or 1 when it failed unexpectedly.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf

from surgery.errors import ConfigError, SurgeryError, did_you_mean

EXIT_BAD_INPUT = 2
# Launcher and sweeper plugins a shipped extra installs: Hydra's "Could not find" gets the pip line.
PLUGIN_EXTRAS = {
    "hydra/launcher/joblib": "sweep",
    "hydra/launcher/submitit_slurm": "slurm",
    "hydra/launcher/submitit_local": "slurm",
}
# Under safe=true a logging config may name only these classes (Hydra's defaults use the first two).
SAFE_LOG_CLASSES = (
    "logging.StreamHandler", "logging.FileHandler", "logging.NullHandler", "logging.Formatter", "logging.Filter",
    "logging.handlers.RotatingFileHandler", "logging.handlers.TimedRotatingFileHandler",
    "logging.handlers.WatchedFileHandler",
)  # fmt: skip
SAFE_LOG_STREAMS = ("ext://sys.stdout", "ext://sys.stderr")


def refuse(message: str) -> NoReturn:
    """One line on stderr and exit 2: the CLI's answer to bad input."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def safe_in(config: Any) -> bool:
    """Whether a composed config asks for safe mode: anything but an explicit false (it is not validated yet)."""
    value = OmegaConf.select(config, "safe", default=False, throw_on_resolution_failure=False)
    return value not in (False, None, 0, "false", "False")


def check_logging(config: DictConfig) -> None:
    """Under safe mode, refuse a logging config that could run code: ``()`` factories, other classes, ``ext://``.

    ``logging.config.dictConfig`` imports and calls what ``()`` and ``class`` name and imports what
    ``ext://`` names; Hydra applies ``hydra.hydra_logging`` right after composing, before any callback.
    A value that cannot be resolved yet (``${hydra.runtime.output_dir}`` in a file name) is checked
    again when Hydra configures logging (:func:`_guard_configure`); here only its text is.
    """
    for key in ("hydra_logging", "job_logging"):
        where = f"hydra.{key}"
        found = OmegaConf.select(config, where, default=None, throw_on_resolution_failure=False)
        if found is not None:  # None: no logging config, Hydra's plain default names nothing
            _check_log_node(_readable(found), where)


def _readable(node: Any) -> Any:
    """A config node as plain values, each resolved where it can be now and left as its text where not."""
    if isinstance(node, DictConfig):
        return {str(k): _readable(_value(node, k)) for k in node.keys()}
    if OmegaConf.is_list(node):
        return [_readable(_value(node, i)) for i in range(len(node))]
    return node


def _value(node: Any, key: Any) -> Any:
    try:
        return node[key]
    except Exception:  # noqa: BLE001 - e.g. hydra.runtime is filled in later: keep the text
        return str(node._get_node(key)._value())


def _check_log_node(node: Any, where: str) -> None:
    allowed = f"safe=true admits only {', '.join(SAFE_LOG_CLASSES)} and {' or '.join(SAFE_LOG_STREAMS)} there"
    if isinstance(node, dict):
        for key, value in node.items():
            at = f"{where}.{key}"
            if key in ("()", "."):
                raise ConfigError(f"{at}: a logging factory or property can run any code; {allowed}")
            if key == "class" and value not in SAFE_LOG_CLASSES:
                raise ConfigError(f"{at}: {value!r} is not allowed; {allowed}")
            _check_log_node(value, at)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_log_node(value, f"{where}[{i}]")
    elif isinstance(node, str) and node.startswith("ext://") and node not in SAFE_LOG_STREAMS:
        raise ConfigError(f"{where}: {node!r} imports a module; {allowed}")


def _guard_configure(configure: Any) -> Any:
    """Wrap Hydra's ``configure_log``: under safe mode, check the logging config resolved, just before it is applied."""

    def configure_log(log_config: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(log_config, DictConfig) and safe_in(log_config._get_root()):
            where = log_config._get_full_key(None) or "hydra logging"
            try:
                _check_log_node(OmegaConf.to_container(log_config, resolve=True), where)
            except SurgeryError as e:
                refuse(str(e))
        return configure(log_config, *args, **kwargs)

    return configure_log


def _guard_composed(load: Any) -> Any:
    """Wrap ``ConfigLoaderImpl.load_configuration``: safe mode's checks run on every composed config."""

    def load_configuration(self: Any, *args: Any, **kwargs: Any) -> DictConfig:
        config = load(self, *args, **kwargs)
        if safe_in(config):
            from surgery.core.callables import check_callbacks

            try:
                check_logging(config)
                try:
                    callbacks = OmegaConf.to_container(OmegaConf.select(config, "hydra.callbacks"), resolve=True)
                except Exception:  # noqa: BLE001
                    raise ConfigError("hydra.callbacks: cannot be read, so safe=true cannot check it") from None
                check_callbacks(callbacks, safe=True)
            except SurgeryError as e:
                refuse(str(e))
        return config

    return load_configuration


def _known_keys(cfg: DictConfig, parent: str) -> list[str] | None:
    """The keys a node may take though its YAML does not set them; None when surgery does not know the node."""
    from surgery.app.build import MODEL_KEYS
    from surgery.app.inputs import INPUT_KINDS

    inputs = sorted({k for keys in INPUT_KINDS.values() for k in keys})
    if parent in ("input", "source", "model.input"):
        return inputs
    if parent == "model":
        return list(MODEL_KEYS)
    if parent == "":
        from surgery.app.build import GROUP_KEYS
        from surgery.core.schema import RunSettings

        return [*RunSettings.__dataclass_fields__, *GROUP_KEYS]
    if parent.startswith("actions.") and parent.count(".") == 1:
        import dataclasses

        from surgery.actions import KINDS
        from surgery.core.schema import yaml_key

        kind = OmegaConf.select(cfg, f"{parent}.kind", default=None, throw_on_resolution_failure=False)
        if kind not in KINDS.names():
            return None
        return sorted(yaml_key(f.name) for f in dataclasses.fields(KINDS.get(str(kind)).schema))
    return None


def _check_override(override: Any, cfg: DictConfig) -> None:
    """A plain ``a.b=v`` of a key the config does not have yet: add a key surgery knows, else say what is meant."""
    from hydra.core.override_parser.types import OverrideType

    key = str(override.key_or_group)
    if override.type != OverrideType.CHANGE or override.package is not None or key.split(".")[0] == "hydra":
        return
    parent, _, name = key.rpartition(".")
    if key.startswith("actions."):  # actions.NAME.KEY=...: NAME must be an action of this run
        action = key.split(".")[1]
        actions = [str(a) for a in (cfg.get("actions") or {})]
        if action not in actions:
            listed = ", ".join(actions) or "none; choose some with +actions=NAME"
            close = did_you_mean(action, actions)
            add = f" To add one: '+actions.{action}={{kind: ..., select: ...}}'."
            refuse(f"actions.{action}: no such action in this run.{close} Actions: {listed}.{add}")
    node = cfg if not parent else OmegaConf.select(cfg, parent, default=None, throw_on_resolution_failure=False)
    if not isinstance(node, DictConfig) or name in node.keys():  # keys(): a ??? value is "not in" a DictConfig
        return
    known = _known_keys(cfg, parent)
    if known is None:
        return
    if name in known:  # e.g. input.shape=[...] on a model whose input config does not set it
        override.type = OverrideType.FORCE_ADD
        return
    known = list(dict.fromkeys([*map(str, node.keys()), *known]))  # the file's own keys too (cnn's trained, ...)
    hint = f" A new argument of model._target_ needs a +: +{override.input_line}" if parent == "model" else ""
    refuse(f"{key}: unknown key.{did_you_mean(name, known)} Keys here: {', '.join(known)}.{hint}")


def _patch_overrides(apply: Any) -> Any:
    def apply_overrides(overrides: list[Any], cfg: DictConfig) -> None:
        for override in overrides:
            _check_override(override, cfg)
        apply(overrides, cfg)

    return staticmethod(apply_overrides)


def _message(error: Exception) -> str | None:
    """Our words for a Hydra composition error a new user meets, or None to leave Hydra's."""
    text = str(error)
    for missing, extra in PLUGIN_EXTRAS.items():
        if f"Could not find '{missing}'" in text:
            name = missing.rsplit("/", 1)[1]
            return f"{missing.replace('/' + name, '')}={name}: not installed; pip install 'surgery[{extra}]'"
    if "Cannot merge DictConfig with ListConfig" in text and "In 'actions/" in text:
        name = text.split("In 'actions/", 1)[1].split("'", 1)[0]
        return (
            f"actions/{name}: an actions file is a mapping of named actions (NAME: {{kind: ..., select: ...}}),"
            " not a YAML list"
        )
    return None


def _failed_job(error: Exception) -> tuple[str, bool] | None:
    """A submitit job that ended without a result: (what to print, whether it was bad input), or None.

    The job exited (``sys.exit(2)`` with its one-line error, or exit 1 after a traceback) or was
    killed; submitit then raises ``UncompletedJobError`` holding the job's error stream.
    """
    # submitit.core.utils's class (or its FailedJobError), by name: the slurm extra may be absent
    if "UncompletedJobError" not in {kind.__name__ for kind in type(error).__mro__}:
        return None
    text = str(error)
    lines = text.splitlines()
    path = re.search(r" with path (\S+)", lines[0])
    logs = f"job logs: {Path(path.group(1)).parent}" if path else "job logs: hydra.sweep.dir/.submitit/"
    said = [line for line in lines if line.startswith("error: ")]
    if said and "unexpected internal failure" not in said[-1]:
        return f"{said[-1].removeprefix('error: ')} ({logs})", True
    return f"{text}\nerror: a sweep job failed ({logs})", False


def _translating(run_and_report: Any) -> Any:
    def translated(func: Any) -> Any:
        def call() -> Any:
            try:
                return func()
            except Exception as e:
                failed = _failed_job(e)
                if failed is not None:
                    text, bad_input = failed
                    if bad_input:
                        refuse(text)
                    from surgery.app.cli import InternalFailure

                    print(text, file=sys.stderr)
                    raise InternalFailure(1) from None
                message = _message(e)
                if message is None:
                    raise
                refuse(message)

        return run_and_report(call)

    return translated


def install() -> None:
    """Put the wrappers in place (once per process)."""
    import hydra._internal.utils as hydra_utils
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    if getattr(ConfigLoaderImpl.load_configuration, "surgery_hook", False):
        return
    load = _guard_composed(ConfigLoaderImpl.load_configuration)
    load.surgery_hook = True
    ConfigLoaderImpl.load_configuration = load  # type: ignore[method-assign]
    apply = _patch_overrides(ConfigLoaderImpl._apply_overrides_to_config)
    ConfigLoaderImpl._apply_overrides_to_config = apply  # type: ignore[method-assign]
    hydra_utils.run_and_report = _translating(hydra_utils.run_and_report)
    import hydra._internal.hydra as hydra_main
    import hydra.core.utils as hydra_core

    hydra_main.configure_log = _guard_configure(hydra_main.configure_log)  # hydra_logging, after composing
    hydra_core.configure_log = _guard_configure(hydra_core.configure_log)  # job_logging, in run_job
