"""safe=true over the whole Hydra tree, resolvers and interpolations: a red-team corpus (docs/sharing.md).

Each case composes the real ``conf/`` with Hydra's own ``compose`` and overrides (cheap, in-process) and
runs the check the CLI runs right after every composition (``check_composed``): a refusal is one line
naming the key. A few real command lines prove the end-to-end path: exit 2, one ``error:`` line, and
no marker file or file outside the run directory.
"""

from __future__ import annotations

import json
import logging.config
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from omegaconf import OmegaConf

from surgery.app import hydra_hooks, hydra_messages
from surgery.app.hydra_hooks import check_composed
from surgery.app.hydra_messages import printable
from surgery.core.paths import config_dir
from surgery.errors import ConfigError
from surgery.safe.hydra_tree import check_sweep_size
from surgery.safe.interpolations import check_interpolations
from surgery.safe.logging_tree import check_log_files

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:provider=hydra.searchpath:UserWarning")  # pkg://evil: never read
CPUS = os.cpu_count() or 1


@pytest.fixture(autouse=True)
def plain_hydra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose without the CLI's wrapper (another test may have installed it): these tests call the check."""
    current = ConfigLoaderImpl.load_configuration
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", getattr(current, "surgery_original", current))


def hydra_composed(*overrides: str, config_dir_: Path | None = None) -> Any:
    """The composed config with its ``hydra`` node, as the CLI's wrapper sees it."""
    directory = str(config_dir_ or config_dir())
    with initialize_config_dir(config_dir=directory, version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def refusal(overrides: list[str], typed: list[str] | None = None, multirun: bool = False) -> str | None:
    """The one-line refusal of ``safe=true`` plus ``overrides`` (None: admitted). ``typed``: the command line's
    overrides as the wrapper sees them (default: the same overrides, all typed). An override ``@YAML`` is an
    experiment file (``# @package _global_``) holding YAML, for keys no override can spell (``()``)."""
    with tempfile.TemporaryDirectory() as directory:
        files = [o[1:] for o in overrides if o.startswith("@")]
        overrides = [o for o in overrides if not o.startswith("@")]
        for text in files:  # "PATH|YAML" for a file of another group, selected by the case's own override
            path, _, body = text.rpartition("|") if "|" in text else ("experiment/x.yaml", "", text)
            (Path(directory) / path).parent.mkdir(parents=True, exist_ok=True)
            header = "# @package _global_\n" if path == "experiment/x.yaml" else ""
            (Path(directory) / path).write_text(header + body)
            if path == "experiment/x.yaml":
                overrides.append("+experiment=x")
        if files:
            overrides.append(f"hydra.searchpath=[file://{directory}]")
        cfg = hydra_composed("safe=true", *overrides)
    try:
        check_composed(cfg, ["safe=true", *(overrides if typed is None else typed)], multirun)
    except ConfigError as e:
        assert "\n" not in str(e)
        return str(e)
    return None


def in_file(overrides: list[str]) -> list[str]:
    """The overrides as a config file would set them: not typed on the command line."""
    return []


H = "hydra.job_logging.handlers"
F = "hydra.job_logging.formatters"
SLURM = "hydra/launcher=submitit_slurm"
JOBLIB = "hydra/launcher=joblib"
BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
LOG = "@hydra:\n job_logging:\n"  # an experiment file setting hydra.job_logging's keys (indented two spaces)
# name -> (overrides, typed on the command line? (False: as if a config file set them), the key the refusal names)
REFUSED: dict[str, tuple[list[str], bool, str]] = {
    # logging: code, sockets, files outside
    "file_handler_py": ([f"{H}.file.filename=" + "${hydra.runtime.output_dir}/evil.py"], True, f"{H}.file.filename"),
    "file_handler_rc": ([f"{H}.file.filename=/root/.bashrc"], True, f"{H}.file.filename"),
    "rotating": ([f"{H}.file.class=logging.handlers.RotatingFileHandler"], True, f"{H}.file.class"),
    "timed_rotating": ([f"{H}.file.class=logging.handlers.TimedRotatingFileHandler"], True, f"{H}.file.class"),
    "watched": ([f"{H}.file.class=logging.handlers.WatchedFileHandler"], True, f"{H}.file.class"),
    "socket_handler": ([f"{H}.console.class=logging.handlers.SocketHandler"], True, f"{H}.console.class"),
    "syslog_handler": ([f"{H}.console.class=logging.handlers.SysLogHandler"], True, f"{H}.console.class"),
    "http_handler": ([f"{H}.console.class=logging.handlers.HTTPHandler"], True, f"{H}.console.class"),
    "memory_handler_target": ([f"+{H}.console.target=file"], True, f"{H}.console.target"),
    "factory_formatter": ([LOG + "  formatters: {plain: {(): colorlog.ColoredFormatter}}"], True, f"{F}.plain.()"),
    "factory_handler": ([LOG + "  handlers: {console: {(): builtins.print}}"], True, f"{H}.console.()"),
    "property_handler": ([LOG + "  handlers: {console: {.: {x: 1}}}"], True, f"{H}.console.."),
    "factory_top": ([LOG + "  (): builtins.print"], True, "hydra.job_logging.()"),
    "ext_stream": ([f"{H}.console.stream=ext://os.environ"], True, f"{H}.console.stream"),
    "stdin_stream": ([f"{H}.console.stream=ext://sys.stdin"], True, f"{H}.console.stream"),
    "formatter_class": ([f"+{F}.plain.class=colorlog.ColoredFormatter"], True, f"{F}.plain.class"),
    "filter_factory": ([LOG + "  filters: {f: {(): builtins.print}}"], True, "hydra.job_logging.filters.f.()"),
    "logger_factory": ([LOG + "  loggers: {x: {(): builtins.print}}"], True, "hydra.job_logging.loggers.x.()"),
    "root_factory": ([LOG + "  root: {(): builtins.print}"], True, "hydra.job_logging.root.()"),
    "file_mode": ([f"+{H}.file.mode=r+"], True, f"{H}.file.mode"),
    "hydra_logging_file": (["hydra/hydra_logging=hydra_debug"], True, "hydra.hydra_logging.handlers.file.class"),
    "bad_format": ([f"{F}.plain.format='%(nope)q'"], True, f"{F}.plain.format"),
    "unknown_field": ([f"{F}.plain.format='%(nope)s'"], True, f"{F}.plain.format"),
    "brace_format": ([f"{F}.plain.format='{{0!z}}'", f"+{F}.plain.style='{{'"], True, f"{F}.plain.format"),
    # environment variables: a process group at an address the config chose
    "env_rank": (["+hydra.job.env_set.RANK=0"], True, "hydra.job.env_set.RANK"),
    "env_world_size": (["+hydra.job.env_set.WORLD_SIZE=2"], True, "hydra.job.env_set.WORLD_SIZE"),
    "env_master_addr": (["+hydra.job.env_set.MASTER_ADDR=10.0.0.1"], True, "hydra.job.env_set.MASTER_ADDR"),
    "env_master_port": (["+hydra.job.env_set.MASTER_PORT=29500"], True, "hydra.job.env_set.MASTER_PORT"),
    "env_local_rank": (["+hydra.job.env_set.LOCAL_RANK=0"], True, "hydra.job.env_set.LOCAL_RANK"),
    "env_any": (["+hydra.job.env_set.PYTHONSTARTUP=/tmp/x.py"], True, "hydra.job.env_set.PYTHONSTARTUP"),
    "env_copy": (["hydra.job.env_copy=[HOME]"], True, "hydra.job.env_copy"),
    "hydra_env": (["+hydra.env.X=1"], True, "hydra.env"),
    # where files go
    "output_subdir_dot": (["hydra.output_subdir=."], True, "hydra.output_subdir"),
    "output_subdir_abs": (["hydra.output_subdir=/tmp/x"], True, "hydra.output_subdir"),
    "output_subdir_up": (["hydra.output_subdir=../x"], True, "hydra.output_subdir"),
    "job_name_up": (["hydra.job.name=../../x"], True, "hydra.job.name"),
    "job_name_slash": (["hydra.job.name=a/b"], True, "hydra.job.name"),
    "job_name_dotfile": (["hydra.job.name=.bashrc"], True, "hydra.job.name"),
    "run_dir_abs_file": (["hydra.run.dir=/tmp/x"], False, "hydra.run.dir"),
    "run_dir_up_file": (["hydra.run.dir=../x"], False, "hydra.run.dir"),
    "run_dir_start_file": (["hydra.run.dir=."], False, "hydra.run.dir"),
    "sweep_dir_home_file": (["hydra.sweep.dir='~/x'"], False, "hydra.sweep.dir"),
    "sweep_subdir_up": (["hydra.sweep.subdir=../x"], True, "hydra.sweep.subdir"),
    "output_subdir_nested_up": (["hydra.output_subdir=.hydra/../.."], True, "hydra.output_subdir"),
    "job_name_empty": (["hydra.job.name=''"], True, "hydra.job.name"),
    "run_dir_from_overrides": (["+x=a/../../..", "hydra.run.dir=out/${hydra.job.override_dirname}"], False,
                               "hydra.run.dir"),
    "env_set_in_file": (["@hydra:\n job:\n  env_set: {RANK: '0'}\n"], False, "hydra.job.env_set.RANK"),
    # launchers and sweepers: what Hydra builds
    "joblib_pre_dispatch": ([JOBLIB, "hydra.launcher.pre_dispatch='__import__(\"os\")'"], True,
                            "hydra.launcher.pre_dispatch"),
    "joblib_mmap_write": ([JOBLIB, "hydra.launcher.mmap_mode=w+"], True, "hydra.launcher.mmap_mode"),
    "slurm_exclude_space": ([SLURM, "hydra.launcher.exclude='a b'"], True, "hydra.launcher.exclude"),
    "submitit_name": ([SLURM, "hydra.launcher.name='x; rm -rf ~'"], True, "hydra.launcher.name"),
    "launcher_list_value": (["+hydra.launcher.x=[1]"], True, "hydra.launcher.x"),
    "sweeper_batch": (["hydra.sweeper.max_batch_size=-1"], True, "hydra.sweeper.max_batch_size"),
    "pickle_callback": (["+hydra.callbacks.x={_target_: hydra.experimental.callbacks.PickleJobInfoCallback}"], True,
                        "hydra.callbacks.x._target_"),
    "launcher_target": (["hydra.launcher._target_=builtins.print"], True, "hydra.launcher._target_"),
    "launcher_nested": (["+hydra.launcher.x={_target_: builtins.open, file: /tmp/m, mode: w}"], True,
                        "hydra.launcher.x"),
    "joblib_n_jobs": ([JOBLIB, "hydra.launcher.n_jobs=1000"], True, "hydra.launcher.n_jobs"),
    "joblib_temp_folder": ([JOBLIB, "hydra.launcher.temp_folder=/tmp/x"], True, "hydra.launcher.temp_folder"),
    "launcher_file_nested": ([f"@hydra/launcher/evil.yaml|_target_: {BASIC}\nx: {{_target_: builtins.print}}\n",
                              "hydra/launcher=evil"], True, "hydra.launcher.x"),
    "launcher_file_args": ([f"@hydra/launcher/evil.yaml|_target_: {BASIC}\n_args_: [{{_target_: builtins.open}}]\n",
                            "hydra/launcher=evil"], True, "hydra.launcher._args_"),
    "launcher_file_joblib": (["@hydra/launcher/evil.yaml|_target_: hydra_plugins.hydra_joblib_launcher.joblib_launcher"
                              ".JoblibLauncher\nn_jobs: 1\nbackend: {_target_: builtins.print}\n",
                              "hydra/launcher=evil"], True, "hydra.launcher.backend"),
    "sweeper_file_nested": (["@hydra/sweeper/evil.yaml|_target_: hydra._internal.core_plugins.basic_sweeper"
                             ".BasicSweeper\nparams: {a: {_target_: builtins.print}}\n", "hydra/sweeper=evil"], True,
                            "hydra.sweeper.params.a"),
    "slurm_setup": ([SLURM, "hydra.launcher.setup=['curl x | sh']"], True, "hydra.launcher.setup"),
    "slurm_parameters": ([SLURM, "+hydra.launcher.additional_parameters.output=/etc/x"], True,
                         "hydra.launcher.additional_parameters"),
    "slurm_newline": ([SLURM, "hydra.launcher.comment='a\nb'"], True, "hydra.launcher.comment"),
    "slurm_srun_args": ([SLURM, "+hydra.launcher.srun_args=[x]"], True, "hydra.launcher.srun_args"),
    "submitit_folder": (["hydra/launcher=submitit_local", "hydra.launcher.submitit_folder=/tmp/x"], True,
                        "hydra.launcher.submitit_folder"),
    "sweeper_target": (["hydra.sweeper._target_=builtins.print"], True, "hydra.sweeper._target_"),
    "sweeper_nested": (["+hydra.sweeper.x={_target_: builtins.print}"], True, "hydra.sweeper.x"),
    "mode_file": (["hydra.mode=MULTIRUN"], False, "hydra.mode"),
    # search path: pkg:// imports the package
    "searchpath_pkg": (["hydra.searchpath=[pkg://evil]"], True, "hydra.searchpath[0]"),
    "searchpath_second": (["hydra.searchpath=[file:///tmp,pkg://evil]"], True, "hydra.searchpath[1]"),
    "callback": (["+hydra.callbacks.x={_target_: builtins.print}"], True, "hydra.callbacks.x._target_"),
    # resolvers: anything but plain interpolation, now and hydra
    "oc_env": (["+secret=${oc.env:HOME}"], True, "secret"),
    "oc_env_default": (["+secret=${oc.env:NOPE,x}"], True, "secret"),
    "oc_decode": (["+x=${oc.decode:'[1]'}"], True, "x"),
    "oc_create": (["@x: \"${oc.create:'{a: 1}'}\"\n"], False, "x"),
    "oc_select": (["+x=${oc.select:seed,1}"], True, "x"),
    "oc_dict_keys": (["+x=${oc.dict.keys:limits}"], True, "x"),
    "custom_resolver": (["+x=${evil:1}"], True, "x"),
    "resolver_in_text": (["+x=a${oc.env:HOME}b"], True, "x"),
    "resolver_in_argument": (["@x: ${now:${oc.env:HOME}}\n"], False, "x"),
    "computed_key": (["@x: ${limits.${seed}}\n"], False, "x"),
    "computed_resolver": (["@x: ${${seed}:1}\n"], False, "x"),
    "safe_itself": (["@y: ${oc.env:HOME}\n"], False, "y"),
    "resolver_in_hydra": (["hydra.run.dir=${oc.env:HOME}"], True, "hydra.run.dir"),
    "resolver_in_model": (["+model=mlp", "model.hidden=${oc.env:HIDDEN}"], True, "model.hidden"),
    "resolver_in_action": (["+actions.a={kind: log, select: '${oc.env:HOME}'}"], True, "actions.a.select"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_hydra_escape_is_refused_naming_its_key(name: str) -> None:
    overrides, typed, key = REFUSED[name]
    message = refusal(overrides, None if typed else in_file(overrides))
    assert message is not None, f"{name}: admitted"
    assert message.startswith(f"{key}: "), message


ALLOWED: dict[str, tuple[list[str], bool]] = {
    "shipped": ([], True),
    "joblib": ([JOBLIB], True),
    "joblib_one_job": ([JOBLIB, "hydra.launcher.n_jobs=1", "hydra.launcher.prefer=threads"], True),
    "submitit_local": (["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"], True),
    "submitit_slurm": ([SLURM, "hydra.launcher.partition=gpu", "hydra.launcher.mem_per_cpu=4G"], True),
    "job_logging_stdout": (["hydra/job_logging=stdout"], True),
    "hydra_logging_disabled": (["hydra/hydra_logging=disabled"], True),
    "run_dir_typed": (["hydra.run.dir=/tmp/anywhere"], True),
    "run_dir_file_relative": (["hydra.run.dir=outputs/mine/${now:%H}"], False),
    "sweep_dir_typed": (["hydra.sweep.dir=/tmp/sweeps", "hydra.sweep.subdir=${hydra.job.override_dirname}"], True),
    "chdir": (["hydra.job.chdir=true"], True),
    "verbose": (["hydra.verbose=true"], True),
    "job_name": (["hydra.job.name=my-job_1"], True),
    "output_subdir": (["hydra.output_subdir=meta"], True),
    "output_subdir_null": (["hydra.output_subdir=null"], True),
    "help_text": (["hydra.help.header=hello ${hydra.job.name}"], True),
    "file_handler_log": ([f"{H}.file.filename=" + "${hydra.runtime.output_dir}/mine.log", f"+{H}.file.mode=w"], True),
    "null_handler": ([f"{H}.console.class=logging.NullHandler"], True),
    "stderr": ([f"{H}.console.stream=ext://sys.stderr"], True),
    "format": ([f"{F}.plain.format='%(asctime)s %(levelname)-8s %(message)s'"], True),
    "plain_interpolation": (["+x=${seed}", "+y={a: '${.b}', b: 1}"], True),
    "escaped_resolver": (["+x=\\${oc.env:HOME}"], True),
    "searchpath_file": (["hydra.searchpath=[file:///tmp]"], True),
    "mode_typed": (["hydra.mode=MULTIRUN"], True),
    "log_callback": (["+hydra.callbacks.x={_target_: hydra.experimental.callbacks.LogJobReturnCallback}"], True),
}


@pytest.mark.parametrize("name", list(ALLOWED))
def test_what_safe_mode_admits_in_the_hydra_tree(name: str) -> None:
    overrides, typed = ALLOWED[name]
    assert refusal(overrides, None if typed else in_file(overrides)) is None


def test_a_search_path_entry_is_a_directory() -> None:
    from surgery.safe.hydra_tree import check_search_entry

    check_search_entry("file:///tmp/conf", "hydra.searchpath[0]")
    check_search_entry("/tmp/conf", "hydra.searchpath[0]")
    for entry in ("pkg://evil", "structured://x", "pkg://hydra.conf"):
        with pytest.raises(ConfigError, match=r"^hydra\.searchpath\[0\]: "):
            check_search_entry(entry, "hydra.searchpath[0]")


@pytest.mark.parametrize("group", ["experiment", "model", "actions", "input"], ids=lambda g: g)
def test_every_shipped_config_file_passes_safe_modes_hydra_and_resolver_checks(group: str) -> None:
    from surgery.core.paths import group_options

    context = {"actions": ["+model=gpt2_tiny"], "input": ["+model=mlp"]}.get(group, [])
    for option in group_options(group):
        refused = refusal([*context, f"+{group}={option}"], multirun=True)
        assert refused is None, option


def test_every_shipped_hydra_option_passes_safe_mode() -> None:
    """The shipped defaults and each launcher, sweeper and logging option a shipped extra installs."""
    for option in ("", JOBLIB, "hydra/launcher=submitit_local", SLURM, "hydra/launcher=basic",
                   "hydra/sweeper=basic", "hydra/job_logging=default", "hydra/hydra_logging=default"):  # fmt: skip
        assert refusal([option] if option else []) is None, option


# ---------------------------------------------------------------- sweeps: bounded before any job runs


@pytest.mark.parametrize(
    ("params", "typed", "limit", "key"),
    [
        ({"a": "range(0,1000)", "b": "range(0,1000)"}, [], None, "hydra.sweeper.params.a"),
        ({}, ["actions.a.value=range(0,1000000)"], None, "actions.a.value"),
        ({"a": "range(0,100)"}, ["b=range(0,200)"], None, "b"),
        ({"a": "1,2,3"}, ["b=1,2"], 5, "hydra.sweeper.params.a"),
    ],
)
def test_a_sweep_of_more_jobs_than_limits_count_is_refused(
    params: dict, typed: list[str], limit: int | None, key: str
) -> None:
    cfg = OmegaConf.create({"limits": {"count": limit}, "hydra": {"sweeper": {"params": params}}})
    with pytest.raises(ConfigError) as info:
        check_sweep_size(cfg, typed)
    assert str(info.value).startswith(f"{key}: the sweep would run more than {limit or 10000:,} jobs")
    assert "limits.count=" in str(info.value)


def test_limits_count_set_without_safe_mode_bounds_a_sweep_too() -> None:
    cfg = hydra_composed("limits.count=3")
    with pytest.raises(ConfigError, match=r"^b: the sweep would run more than 3 jobs"):
        check_composed(cfg, ["limits.count=3", "b=1,2,3,4"], multirun=True)
    check_composed(hydra_composed(), ["b=1,2,3,4"], multirun=True)  # unbounded without safe or a limit


def test_a_sweep_within_limits_count_is_admitted() -> None:
    cfg = OmegaConf.create({"limits": {"count": None}, "hydra": {"sweeper": {"params": {"a": "range(0,100)"}}}})
    check_sweep_size(cfg, ["b=1,2,3", "hydra.launcher.n_jobs=1"])  # 300 jobs


# ---------------------------------------------------------------- logging files, checked again when applied


@pytest.mark.parametrize(
    ("filename", "ok"),
    [("run/x.log", True), ("run/sub/x.log", True), ("run/../x.log", False), ("elsewhere/x.log", False),
     ("run/x.py", False), ("run/link.log", False), ("run/fifo.log", False)],
)  # fmt: skip
def test_a_file_handler_writes_a_regular_log_file_inside_the_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, filename: str, ok: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "outside.log").write_text("keep")
    (tmp_path / "run" / "link.log").symlink_to(tmp_path / "outside.log")
    os.mkfifo(tmp_path / "run" / "fifo.log")
    node = {"handlers": {"file": {"class": "logging.FileHandler", "filename": filename}}}
    if ok:
        check_log_files(node, "hydra.job_logging", Path("run"))
        return
    with pytest.raises(ConfigError, match=r"^hydra\.job_logging\.handlers\.file\.filename: "):
        check_log_files(node, "hydra.job_logging", Path("run"))


def test_logging_is_checked_resolved_when_hydra_applies_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The compose-time text passes (``.log``); resolved, the file is outside the run directory: exit 2, nothing
    opened."""
    outside = tmp_path / "outside.log"
    cfg = OmegaConf.create({
        "safe": True,
        "hydra": {"runtime": {"output_dir": str(tmp_path / "run")}, "job_logging": {
            "version": 1, "handlers": {"file": {"class": "logging.FileHandler", "filename": str(outside)}}}},
    })  # fmt: skip
    called = []
    configure = hydra_hooks._guard_configure(lambda *args: called.append(args))
    with pytest.raises(SystemExit) as stop:
        configure(cfg.hydra.job_logging, False)
    assert stop.value.code == 2 and not called and not outside.exists()
    assert capsys.readouterr().err.startswith("error: hydra.job_logging.handlers.file.filename: ")


def test_a_logging_config_logging_refuses_is_one_line_without_safe(capsys: pytest.CaptureFixture) -> None:
    def configure(config: Any, verbose: Any) -> None:
        logging.config.dictConfig({"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}})

    cfg = OmegaConf.create({"hydra": {"job_logging": {"version": 1}}})
    with pytest.raises(SystemExit) as stop:
        hydra_hooks._guard_configure(configure)(cfg.hydra.job_logging, False)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: hydra.job_logging: ") and err.count("\n") == 1


def test_a_bad_log_format_is_refused_without_safe_mode_too() -> None:
    cfg = hydra_composed(f"{F}.plain.format='%(nope)q'")
    with pytest.raises(
        ConfigError, match=r"^hydra\.job_logging\.formatters\.plain\.format: '%\(nope\)q' is not a valid"
    ):
        check_composed(cfg, [], multirun=False)
    check_composed(hydra_composed(f"{F}.plain.format='%(custom)s'"), [], multirun=False)  # a filter may add it
    check_composed(hydra_composed("+fmt='%(message)s'", f"{F}.plain.format=" + "${fmt}"), [], multirun=False)


# ---------------------------------------------------------------- interpolations: loops and bombs, safe or not


def doubling(levels: int) -> dict[str, str]:
    config = {"a0": "x" * 10}
    config.update({f"a{i}": f"${{a{i - 1}}}${{a{i - 1}}}" for i in range(1, levels + 1)})
    return config


BOMBS = {
    "loop": ({"a": "${b}", "b": "${a}"}, "an interpolation loop"),
    "self_loop": ({"a": "${a}"}, "an interpolation loop"),
    "long_loop": ({f"k{i}": f"${{k{(i + 1) % 50}}}" for i in range(50)}, "an interpolation loop"),
    "relative_loop": ({"a": {"x": "${..b}"}, "b": "${a.x}"}, "an interpolation loop"),
    "container_loop": ({"l": [1, "${l}"]}, "an interpolation loop"),
    "doubling_36": (doubling(36), "would resolve to about"),
    "doubling_in_lists": ({"a0": "x" * 10, **{f"a{i}": [f"${{a{i - 1}}}"] * 4 for i in range(1, 30)}},
                          "would resolve to about"),
    "wide": ({"a": "x" * 1000, "b": "${a}" * 2000}, "would resolve to about"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BOMBS))
@pytest.mark.parametrize("safe", [False, True])
def test_interpolation_loops_and_bombs_are_refused_before_anything_resolves(name: str, safe: bool) -> None:
    import time

    config, said = BOMBS[name]
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        check_interpolations(config, safe=safe)
    assert said in str(info.value) and "\n" not in str(info.value)
    assert time.perf_counter() - start < 2


def test_interpolations_that_resolve_small_pass_without_safe_even_with_resolvers() -> None:
    check_interpolations({"a": "${oc.env:HOME}", "b": "${a}${a}", **doubling(10)}, safe=False)


# ---------------------------------------------------------------- messages: one line, whatever a name holds


@pytest.mark.parametrize("name", ["a\nerror: forged", "a\x1b[31mred", "a\rb", "a\u2028b", "tab\there"])
def test_refusals_escape_control_characters(name: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        hydra_messages.refuse(f"actions.{name}: refused")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\r" not in err and err.startswith("error: actions.")
    assert printable("ok: plain text") == "ok: plain text"


def test_our_messages_for_hydra_failures() -> None:
    assert "nested too deeply" in (hydra_messages.hydra_message(RecursionError()) or "")
    unwritable = hydra_messages.hydra_message(PermissionError(13, "Permission denied", "/proc/x"))
    assert unwritable is not None and unwritable.startswith("/proc/x: cannot write the run directory there")
    assert hydra_messages.hydra_message(ConfigError("actions.a: bad")) == "actions.a: bad"


# ---------------------------------------------------------------- the real command line


def cli(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "0", "SURGERY_SECRET": "hunter2-secret"}
    return subprocess.run(
        [sys.executable, "-m", "surgery", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def refused_end_to_end(result: subprocess.CompletedProcess[str], key: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {key}: "), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_cli_refuses_a_file_handler_writing_outside_the_run_directory(tmp_path: Path) -> None:
    outside = tmp_path / "victim.log"
    result = cli("+model=mlp", "mode=plan", "safe=true", "hydra.run.dir=run",
                 f"hydra.job_logging.handlers.file.filename={outside}", cwd=tmp_path)  # fmt: skip
    refused_end_to_end(result, "hydra.job_logging.handlers.file.filename")
    assert not outside.exists()
    assert all(name == "run" or name.startswith("run/") for name in files_under(tmp_path))


def test_cli_refuses_env_set_rank_and_a_launcher_config_that_builds_code(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    result = cli("+model=mlp", "mode=plan", "safe=true", "+hydra.job.env_set.RANK=0", "+hydra.job.env_set.WORLD_SIZE=2",
                 "+hydra.job.env_set.MASTER_ADDR=10.255.255.1", cwd=tmp_path, timeout=60)  # fmt: skip
    refused_end_to_end(result, "hydra.job.env_set.RANK")
    assert files_under(tmp_path) == set()  # refused before Hydra made a run directory
    launcher = tmp_path / "conf" / "hydra" / "launcher"
    launcher.mkdir(parents=True)
    (launcher / "evil.yaml").write_text(
        "_target_: hydra._internal.core_plugins.basic_launcher.BasicLauncher\n"
        f"x:\n  _target_: builtins.open\n  file: {marker}\n  mode: w\n"
    )
    result = cli("--config-dir", str(tmp_path / "conf"), "-m", "+model=mlp", "mode=plan", "safe=true",
                 "hydra/launcher=evil", cwd=tmp_path)  # fmt: skip
    refused_end_to_end(result, "hydra.launcher.x")
    assert not marker.exists() and not (tmp_path / "multirun").exists()


def test_cli_refuses_a_pkg_search_path_before_importing_it(tmp_path: Path) -> None:
    """Also when safe=true comes from an experiment file composed beside it: decided before the import."""
    marker = tmp_path / "imported"
    (tmp_path / "evilpkg").mkdir()
    (tmp_path / "evilpkg" / "__init__.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    experiment = tmp_path / "conf" / "experiment"
    experiment.mkdir(parents=True)
    (experiment / "careful.yaml").write_text("# @package _global_\nsafe: true\n")
    result = cli("--config-dir", str(tmp_path / "conf"), "+model=mlp", "mode=plan", "+experiment=careful",
                 "hydra.searchpath=[pkg://evilpkg]", cwd=tmp_path)  # fmt: skip
    refused_end_to_end(result, "hydra.searchpath[0]")
    assert not marker.exists()


def test_cli_refuses_an_environment_secret_and_writes_it_nowhere(tmp_path: Path) -> None:
    result = cli("+model=mlp", "mode=plan", "safe=true", "+actions.a={kind: log, select: '${oc.env:SURGERY_SECRET}'}",
                 cwd=tmp_path)  # fmt: skip
    refused_end_to_end(result, "actions.a.select")
    assert "hunter2" not in result.stderr + result.stdout
    assert not any("hunter2" in p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file())


def test_safe_mode_still_runs_a_sweep_with_the_users_own_files_and_a_log_inside(tmp_path: Path) -> None:
    """--config-dir with one's own model and actions, -m with the basic launcher, a FileHandler inside the job's
    run directory, hydra.job.chdir: all admitted under safe=true."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "actions").mkdir()
    (conf / "model" / "mine.yaml").write_text(
        "_target_: surgery.models.mlp.MLP\nin_features: 4\nhidden: 8\ndepth: 1\nout_features: 2\n"
        "input: {shape: [2, 4]}\n"
    )
    (conf / "actions" / "scale.yaml").write_text("scale: {kind: modify_output, select: '**', op: mul, value: 1.0}\n")
    log = "hydra.job_logging.handlers.file.filename=${hydra.runtime.output_dir}/mine.log"
    result = cli("--config-dir", str(conf), "-m", "+model=mine", "+actions=scale", "actions.scale.value=1,2",
                 "safe=true", "hydra.sweep.dir=sweep", "hydra.job.chdir=true", log, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "sweep" / "0" / "mine.log").is_file() and (tmp_path / "sweep" / "1" / "report.json").is_file()
    assert {p.split("/")[0] for p in files_under(tmp_path)} == {"conf", "sweep"}
    report = json.loads((tmp_path / "sweep" / "1" / "report.json").read_text())
    assert report["plan"][0]["kind"] == "modify_output"


def test_importing_surgery_main_does_not_run_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An allowlist check (or a tool) importing ``surgery.__main__`` must not start a run."""
    import importlib

    monkeypatch.setattr(sys, "argv", ["surgery"])  # main() would print the overview
    monkeypatch.delitem(sys.modules, "surgery.__main__", raising=False)
    importlib.import_module("surgery.__main__")
    assert capsys.readouterr().out == ""


def test_cli_says_one_line_for_an_unwritable_run_directory_and_a_config_nested_too_deeply(tmp_path: Path) -> None:
    """Without safe=true too: Hydra's own failures (creating the run directory, a RecursionError) are bad input."""
    result = cli("+model=mlp", "mode=plan", "hydra.run.dir=/proc/surgery-run", cwd=tmp_path)
    refused_end_to_end(result, "/proc/surgery-run")
    assert "cannot write the run directory there" in result.stderr
    deep = "+x=" + "[" * 3000 + "]" * 3000
    result = cli("+model=mlp", "mode=plan", deep, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: the config is nested too deeply"), result.stderr
    assert result.stderr.count("\n") == 1


def test_a_missing_config_is_not_mistaken_for_an_unwritable_run_directory() -> None:
    from hydra.errors import MissingConfigException

    missing = MissingConfigException("Could not find 'hydra/launcher/nope'", "hydra/launcher/nope")
    assert "run directory" not in (hydra_messages.hydra_message(missing) or "")
