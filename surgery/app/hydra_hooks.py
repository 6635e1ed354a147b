"""Where surgery steps into Hydra before the task runs: safe mode's checks and messages in our words.

Hydra has no hook between composing a config and acting on it (building ``hydra.callbacks``,
launchers and sweepers, configuring logging, setting ``env_set``), nor for its own error messages, so
these wrap the few Hydra functions involved. After every composition (:func:`check_composed`):
interpolation loops and sizes for everyone, and under ``safe=true`` resolvers and the ``hydra.*``
allowlist (``surgery/safe/hydra_tree.py``, ``logging_tree.py``; docs/sharing.md); a ``pkg://`` search path is
refused before Hydra reads it. Each wrapper refuses with one ``error: ...`` line and exit 2; Hydra's own
errors are put in our words by :mod:`surgery.app.hydra_messages`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from surgery.app.hydra_messages import NESTED_TOO_DEEPLY, refuse, translating
from surgery.errors import SurgeryError, did_you_mean


def safe_in(config: Any) -> bool:
    """Whether a composed config asks for safe mode: anything but an explicit false (it is not validated yet).

    Read unresolved: ``safe: ${oc.env:X}`` must not run its resolver before the resolvers are checked.
    """
    try:
        node = config._get_node("safe") if isinstance(config, DictConfig) else None
    except Exception:  # noqa: BLE001 - a structured config without the key
        node = None
    value = node._value() if node is not None else False
    return value not in (False, None, 0, "false", "False")


def check_logging(config: DictConfig) -> None:
    """Under safe mode, refuse a logging config that could run code or write outside the run directory."""
    from surgery.safe.logging_tree import check_logging as check

    check(config)


def check_composed(config: DictConfig, overrides: list[str], multirun: bool) -> None:
    """Every composed config: interpolation loops and sizes, log formats; under safe mode resolvers and the Hydra tree.

    Runs before anything resolves a value or Hydra acts on its node (docs/sharing.md).
    """
    from surgery.safe.hydra_tree import check_hydra, check_sweep_size
    from surgery.safe.interpolations import check_interpolations
    from surgery.safe.logging_tree import check_formats

    safe = safe_in(config)
    check_interpolations(OmegaConf.to_container(config, resolve=False, enum_to_str=True), safe)
    check_formats(config, safe)
    if safe:
        check_hydra(config, list(overrides), multirun)
    elif multirun and OmegaConf.select(config, "limits.count", default=None) is not None:
        check_sweep_size(config, list(overrides))  # a limit set without safe mode holds for sweeps too


def _guard_configure(configure: Any) -> Any:
    """Wrap Hydra's ``configure_log``: under safe mode check the logging config resolved, just before it is applied;
    a logging config that logging itself refuses is bad input (one line), safe or not."""

    def configure_log(log_config: Any, *args: Any, **kwargs: Any) -> Any:
        where = "hydra logging"
        if isinstance(log_config, DictConfig):
            where = log_config._get_full_key(None) or where
            if safe_in(log_config._get_root()):
                _check_resolved_logging(log_config, where)
            _no_log_through_a_link(log_config, where)
        try:
            return configure(log_config, *args, **kwargs)
        except (ValueError, TypeError, AttributeError, ImportError, OSError) as e:
            cause = e.__cause__ or e
            refuse(f"{where}: logging cannot be configured from it ({type(cause).__name__}: {cause})")

    return configure_log


def _no_log_through_a_link(log_config: DictConfig, where: str) -> None:
    """A log file in the run directory that is a symlink (a resumed run dir from others) is refused, safe or not."""
    from surgery.files.gate import writable, writing_into

    run_dir = OmegaConf.select(log_config._get_root(), "hydra.runtime.output_dir", default=None)
    handlers = OmegaConf.select(log_config, "handlers", default=None, throw_on_resolution_failure=False)
    if run_dir is None or not isinstance(handlers, DictConfig):
        return
    try:
        with writing_into(str(run_dir)):
            for name in map(str, handlers.keys()):
                file = OmegaConf.select(handlers, f"{name}.filename", default=None, throw_on_resolution_failure=False)
                if isinstance(file, str):
                    writable(file, f"{where}.handlers.{name}.filename")
    except SurgeryError as e:
        refuse(str(e))


def _save_config(cfg: DictConfig, filename: str, output_dir: Path) -> None:
    """Hydra's ``.hydra/*.yaml``, written through the gate: atomically, and never through a link in the run dir."""
    from surgery.files.gate import writing_into
    from surgery.files.write import write_text

    try:
        with writing_into(output_dir.parent):
            write_text(output_dir / filename, OmegaConf.to_yaml(cfg), "hydra.output_subdir")
    except SurgeryError as e:
        refuse(str(e))


def _check_resolved_logging(log_config: DictConfig, where: str) -> None:
    from surgery.safe.logging_tree import check_log_files, check_log_node

    try:
        resolved = OmegaConf.to_container(log_config, resolve=True)
        check_log_node(resolved, where, files=where.endswith("job_logging"))
        run_dir = OmegaConf.select(log_config._get_root(), "hydra.runtime.output_dir", default=None)
        if run_dir is None and isinstance(resolved, dict) and resolved.get("handlers"):
            run_dir = "."
        check_log_files(resolved, where, Path(str(run_dir)))
    except SurgeryError as e:
        refuse(str(e))


def _searchpath_first(self: Any, load: Any, config_name: Any, overrides: list[str], run_mode: Any) -> None:
    """Under safe mode, refuse a ``pkg://`` search path before Hydra reads it (reading it imports the package).

    Whether the run is safe is read from a composition without those entries; where that cannot be
    composed, from the command line and the primary config.
    """
    from surgery.safe.hydra_tree import check_search_entry

    typed = [o for o in overrides if o.partition("=")[0].lstrip("+") == "hydra.searchpath"]
    entries = _search_entries(self, config_name, typed)
    imports = [(i, e) for i, e in enumerate(entries) if "://" in e and not e.startswith("file://")]
    if not imports:
        return
    files = ",".join(repr(e) for e in entries if "://" not in e or e.startswith("file://"))
    kept = [o for o in overrides if o not in typed]
    try:
        safe = safe_in(load(self, config_name, [*kept, f"hydra.searchpath=[{files}]"], run_mode, False, False))
    except Exception:  # noqa: BLE001 - e.g. the experiment is only in that package: the command line decides
        said = [o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+") == "safe"]
        safe = said[-1] not in ("false", "False", "0", "null") if said else False
    if safe:
        index, entry = imports[0]
        try:
            check_search_entry(entry, f"hydra.searchpath[{index}]")
        except SurgeryError as e:
            refuse(str(e))


def _search_entries(self: Any, config_name: Any, typed: list[str]) -> list[str]:
    """The search path Hydra is about to read: the command line's ``hydra.searchpath``, else the primary config's."""
    try:
        if typed:
            from hydra.core.override_parser.overrides_parser import OverridesParser

            value = OverridesParser.create().parse_overrides(typed[-1:])[0].value()
        else:
            primary = self.repository.load_config(config_name) if config_name else None
            value = OmegaConf.select(primary.config, "hydra.searchpath", default=None) if primary else None
        return [str(e) for e in value] if isinstance(value, list) or OmegaConf.is_list(value) else []  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - Hydra says what is wrong with it
        return []


def _guard_composed(load: Any) -> Any:
    """Wrap ``ConfigLoaderImpl.load_configuration``: :func:`check_composed` runs on every composed config."""

    def load_configuration(
        self: Any,
        config_name: Any,
        overrides: list[str],
        run_mode: Any,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
    ) -> DictConfig:
        ready = vars(self).pop("_surgery_composed", None)  # only ever for the very next composition
        if ready is not None and ready[0] == (
            config_name,
            list(overrides),
            run_mode,
            from_shell,
            validate_sweep_overrides,
        ):
            return ready[1]  # composed and checked by get_mode just now, for this same request
        _searchpath_first(self, load, config_name, list(overrides), run_mode)
        config = load(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
        try:
            check_composed(config, list(overrides), multirun=getattr(run_mode, "name", "") == "MULTIRUN")
        except SurgeryError as e:
            refuse(str(e))
        except RecursionError:
            refuse(NESTED_TOO_DEEPLY)
        return config

    return load_configuration


def _guard_get_mode(get_mode: Any) -> Any:
    """Wrap ``Hydra.get_mode`` so that a plain run composes its config once, not twice.

    Hydra composes the whole config (as a sweep) only to read ``hydra.mode``, then composes it again
    to run. Here the run's own composition is made first, with the checks, and ``hydra.mode`` read
    from it; when the run goes ahead as a run, Hydra's second request gets that config (the
    ``hydra.mode=RUN`` override Hydra then adds is applied to it as Hydra would). Where the run's
    composition fails (sweep values without ``-m``, a missing option), Hydra's own ``get_mode`` decides,
    and the error is Hydra's, reported where it reports it.
    """

    def guarded_get_mode(self: Any, config_name: Any, overrides: list[str]) -> Any:
        from hydra.types import RunMode

        loader = self.config_loader
        try:
            config = loader.load_configuration(config_name, list(overrides), RunMode.RUN)
            mode = config.hydra.mode
        except Exception:  # noqa: BLE001 - Hydra's own get_mode and run say what is wrong, as before
            return get_mode(self, config_name, overrides)
        if mode == RunMode.MULTIRUN:
            return mode
        expected = list(overrides)
        if mode is None:  # Hydra's _run_app then runs with hydra.mode=RUN appended: apply it here as Hydra would
            expected.append("hydra.mode=RUN")
            config.hydra.mode = RunMode.RUN
            config.hydra.overrides.hydra.append("hydra.mode=RUN")
        vars(loader)["_surgery_composed"] = ((config_name, expected, RunMode.RUN, True, True), config)
        return mode

    guarded_get_mode.surgery_original = get_mode  # type: ignore[attr-defined]  # tests compare with Hydra's own
    return guarded_get_mode


def _known_keys(cfg: DictConfig, parent: str) -> list[str] | None:
    """The keys a node may take though its YAML does not set them; None when surgery does not know the node."""
    from surgery.app.build import MODEL_KEYS
    from surgery.app.inputs import INPUT_KINDS

    inputs = sorted({k for keys in INPUT_KINDS.values() for k in keys})
    if parent in ("input", "source", "model.input"):
        return inputs
    if parent == "study":
        from surgery.study.config import StudyConfig

        return list(StudyConfig.__dataclass_fields__)
    if parent == "model":
        return list(MODEL_KEYS)
    if parent == "":
        from surgery.core.schema import GROUP_KEYS, RunSettings

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


def install() -> None:
    """Put the wrappers in place (once per process)."""
    import hydra._internal.utils as hydra_utils
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from surgery.safe import yaml_guard

    yaml_guard.install()  # YAML alias bombs and deep nesting refused as each file is read
    if getattr(ConfigLoaderImpl.load_configuration, "surgery_hook", False):
        return
    load = _guard_composed(ConfigLoaderImpl.load_configuration)
    load.surgery_hook = True
    load.surgery_original = ConfigLoaderImpl.load_configuration  # tests compose without the checks
    ConfigLoaderImpl.load_configuration = load  # type: ignore[method-assign]
    apply = _patch_overrides(ConfigLoaderImpl._apply_overrides_to_config)
    ConfigLoaderImpl._apply_overrides_to_config = apply  # type: ignore[method-assign]
    hydra_utils.run_and_report = translating(hydra_utils.run_and_report)
    from hydra._internal.hydra import Hydra

    Hydra.get_mode = _guard_get_mode(Hydra.get_mode)  # type: ignore[method-assign]
    import hydra._internal.hydra as hydra_main
    import hydra.core.utils as hydra_core

    hydra_main.configure_log = _guard_configure(hydra_main.configure_log)  # hydra_logging, after composing
    hydra_core.configure_log = _guard_configure(hydra_core.configure_log)  # job_logging, in run_job
    hydra_core._save_config = _save_config  # .hydra/config.yaml and the rest, through surgery/files/
