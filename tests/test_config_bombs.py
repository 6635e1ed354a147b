"""Red team: a few bytes of config that would cost minutes or gigabytes are refused first (issue 25).

Every case runs in this process through the CLI's own job (``run_job``, which enforces the run's
``limits``) and must end in one ``ConfigError`` line naming the key or the file, within seconds and
without the process's peak memory growing: the refusal comes before the allocation. YAML bombs are
refused for everyone; counts and sizes under ``safe=true`` (or an explicit ``limits``). A few cases run
the real command line (exit 2, one line) and paste the suggested setting back.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import DictConfig

from surgery.app.hydra_hooks import install
from surgery.app.job import run_job
from surgery.core.limits import SAFE_DEFAULTS, Limits, enforced
from surgery.errors import ConfigError, SurgeryError
from tests.test_cli import cli, composed


@pytest.fixture(autouse=True, scope="module")
def cli_hooks() -> Iterator[None]:
    """The CLI's Hydra hooks (the YAML guard among them) for compose() in this module only; put back after,
    so other modules compose as Hydra does (an override the hooks refuse would exit instead of raising)."""
    import hydra._internal.hydra as hydra_main
    import hydra._internal.utils as hydra_utils
    import hydra.core.utils as hydra_core
    import omegaconf._utils as omegaconf_utils
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from omegaconf import basecontainer

    patched = [(ConfigLoaderImpl, "load_configuration"), (ConfigLoaderImpl, "_apply_overrides_to_config"),
               (hydra_utils, "run_and_report"), (hydra_main, "configure_log"), (hydra_core, "configure_log"),
               (omegaconf_utils, "get_yaml_loader"), (basecontainer, "get_yaml_loader")]  # fmt: skip
    before = [(owner, name, vars(owner)[name]) for owner, name in patched]
    install()
    yield
    for owner, name, value in before:
        setattr(owner, name, value)


SECONDS = 30  # generous on a loaded 2-core machine; each case takes well under a few seconds alone
GROWTH_KB = 1_500_000  # peak memory may not grow by more than ~1.5 GB during a case


def laughs(anchor: str = "a", levels: int = 9, width: int = 10, mapping: bool = False) -> str:
    """Billion laughs: each level holds ``width`` aliases of the one before, ``width ** levels`` leaves in all."""
    if mapping:
        first = f"{anchor}0: &{anchor}0 {{" + ", ".join(f"k{i}: x" for i in range(width)) + "}"
        rest = [
            f"{anchor}{n}: &{anchor}{n} {{" + ", ".join(f"k{i}: *{anchor}{n - 1}" for i in range(width)) + "}"
            for n in range(1, levels)
        ]
    else:
        first = f"{anchor}0: &{anchor}0 [" + ",".join(["x"] * width) + "]"
        rest = [
            f"{anchor}{n}: &{anchor}{n} [" + ",".join([f"*{anchor}{n - 1}"] * width) + "]" for n in range(1, levels)
        ]
    return "\n".join([first, *rest]) + "\n"


def nested_flow(depth: int) -> str:
    return "deep: " + "[" * depth + "]" * depth + "\n"


def nested_block(depth: int) -> str:
    return "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "v: 1\n"


GLOBAL = "# @package _global_\n"
MLP = "_target_: surgery.models.mlp.MLP\ninput: {shape: [2, 16]}\n"


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --config-dir of someone else's files: every YAML bomb class, in actions, model and experiment files."""
    root = tmp_path_factory.mktemp("bombs")
    files = {
        "actions/laughs.yaml": laughs(),
        "actions/laughs_map.yaml": laughs(mapping=True),
        "actions/laughs_deep.yaml": laughs(levels=30, width=2),  # 2**30 leaves, 30 lines
        "actions/flow_deep.yaml": nested_flow(3000),
        "actions/block_deep.yaml": nested_block(3000),
        "actions/calls.yaml": "c: {kind: capture, select: head, calls: [" + ",".join(map(str, range(300_000))) + "]}\n",
        "actions/many.yaml": "".join(f"a{i}: {{kind: log, select: head}}\n" for i in range(20_000)),
        "actions/six.yaml": "".join(f"a{i}: {{kind: log, select: head}}\n" for i in range(6)),
        "actions/calls101.yaml": "c: {kind: capture, select: head, calls: [" + ",".join(map(str, range(101))) + "]}\n",
        "model/laughs.yaml": MLP + laughs("m"),
        "model/deep.yaml": MLP + nested_flow(500),
        "experiment/laughs.yaml": GLOBAL + "seed: 1\n" + laughs("e"),
        "experiment/deep.yaml": GLOBAL + nested_block(1000),
        "experiment/seed.yaml": GLOBAL + "seed: 1000000000000000000000000000000\n",
        "experiment/batches.yaml": GLOBAL + "safe: true\ninput: {batches: 1000000000000}\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def refused(*overrides: str, out: Path) -> str:
    """The one-line ConfigError a job with these overrides ends in, checked for time and memory."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    clock = time.perf_counter()
    with pytest.raises(SurgeryError) as caught:  # a ConfigError, or an ActionError naming the key and the module
        cfg = composed(*overrides)
        run_job(cfg, out)
    seconds = time.perf_counter() - clock
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    message = str(caught.value)
    assert "\n" not in message, message
    assert seconds < SECONDS, (seconds, message)
    assert grown < GROWTH_KB, (grown, message)
    return message


SIZED = ("actions.r.with:", "model:", "input.shape:", "input.shapes:", "actions.p.shape:", "actions.m.fn")
SAFE = "safe=true"
FROM = "hydra.searchpath=[file://DIR]"  # the user's directory above, as --config-dir would add it


def replace(target: str, select: str = "select: head", **args: int) -> str:
    """A replace_module action building ``target(**args)``."""
    given = ", ".join(f"{k}: {v}" for k, v in args.items())
    return f"+actions.r={{kind: replace_module, {select}, with: {{_target_: torch.nn.{target}, {given}}}}}"


def partial(function: str, args: str, select: str = "select: head") -> str:
    """A modify_output action whose op is ``torch.nn.functional.FUNCTION`` with ``args`` bound (``_partial_``)."""
    fn = f"{{_target_: torch.nn.functional.{function}, _partial_: true, _convert_: all, {args}}}"
    return f"+actions.m={{kind: modify_output, {select}, op: fn, fn: {fn}}}"


def add(kind: str, shape: str, select: str = "select: head") -> str:
    return f"+actions.p={{kind: {kind}, {select}, name: big, shape: {shape}}}"


def yaml_bomb(group: str, option: str, says: str, *more: str) -> tuple[str, list[str], str, str]:
    """A case reading DIR/GROUP/OPTION.yaml: refused naming that file."""
    chosen = ["+model=mlp"] if group == "actions" else []
    return (f"{option}-{group}", [*more, *chosen, f"+{group}={option}", FROM], f"DIR/{group}/{option}.yaml", says)


M = 1_000_000
# (case id, overrides, the message starts with, a piece of the message). DIR is the --config-dir above.
CASES = [
    # YAML bombs: refused when the file is read, for everyone (safe=false unless said)
    yaml_bomb("actions", "laughs", "aliases"),
    yaml_bomb("actions", "laughs_map", "aliases"),
    yaml_bomb("actions", "laughs_deep", "aliases"),  # 2**30 leaves in 30 lines
    ("laughs-safe", [SAFE, "+model=mlp", "+actions=laughs", FROM], "DIR/actions/laughs.yaml", "aliases"),
    yaml_bomb("model", "laughs", "aliases"),
    yaml_bomb("experiment", "laughs", "aliases"),
    yaml_bomb("actions", "flow_deep", "deeper than 100"),
    yaml_bomb("actions", "block_deep", "deeper than 100"),
    yaml_bomb("model", "deep", "deeper than 100"),
    yaml_bomb("experiment", "deep", "deeper than 100"),
    yaml_bomb("actions", "calls", "more than 50,000 nodes"),  # a 300,000-entry calls list
    yaml_bomb("actions", "many", "more than 50,000 nodes"),  # 20,000 actions
    # seeds: a config error in any mode, never a traceback
    ("seed-10-pow-30", ["+model=mlp", f"seed={10**30}"], "seed:", "out of range"),
    ("seed-10-pow-30-safe", [SAFE, "+model=mlp", f"seed={10**30}"], "seed:", "out of range"),
    ("seed-below-int64", ["+model=mlp", f"seed={-(2**63) - 1}"], "seed:", "out of range"),
    ("seed-2-pow-64-plan", ["+model=mlp", "mode=plan", f"seed={2**64}"], "seed:", "out of range"),
    ("seed-in-experiment", ["+experiment=seed", "+model=mlp", FROM], "seed:", "out of range"),
    # counts: bounded by limits.count (10000 under safe=true)
    ("batches-10-pow-12", [SAFE, "+model=mlp", f"+input.batches={10**12}"], "input.batches:", "limits.count=10000"),
    ("batches-experiment", ["+experiment=batches", "+model=mlp", FROM], "input.batches:", "limits.count=10000"),
    ("batches-set-limit", ["+model=mlp", "+input.batches=101", "limits.count=100"], "input.batches:", "count=101"),
    ("actions-count", [SAFE, "limits.count=5", "+model=mlp", "+actions=six", FROM], "actions:", "6 actions"),
    (
        "calls-count",
        [SAFE, "limits.count=100", "+model=mlp", "+actions=calls101", FROM],
        "actions.c.calls:",
        "101 call",
    ),
    # sizes reached through allowed callables and models: refused before allocating (8 GB under safe=true)
    (
        "replace-linear-10-pow-6",
        [SAFE, "+model=mlp", replace("Linear", in_features=M, out_features=M)],
        "actions.r.with:",
        "3.73e+03 GB",
    ),
    (
        "replace-every-copy",
        [SAFE, "+model=mlp", replace("Linear", "type: Linear", in_features=30000, out_features=30000)],
        "actions.r.with:",
        "4 × torch.nn.Linear",
    ),
    (
        "replace-embedding",
        [SAFE, "+model=mlp", replace("Embedding", num_embeddings=1000 * M, embedding_dim=64)],
        "actions.r.with:",
        "torch.nn.Embedding",
    ),
    (
        "replace-conv",
        [
            SAFE,
            "+model=cnn",
            replace("Conv2d", "select: block1.conv", in_channels=100000, out_channels=100000, kernel_size=3),
        ],
        "actions.r.with:",
        "torch.nn.Conv2d",
    ),
    (
        "replace-bilinear",
        [SAFE, "+model=mlp", replace("Bilinear", in1_features=10000, in2_features=10000, out_features=10000)],
        "actions.r.with:",
        "torch.nn.Bilinear",
    ),
    (
        "replace-lstm",
        [SAFE, "+model=mlp", replace("LSTM", input_size=100000, hidden_size=100000)],
        "actions.r.with:",
        "torch.nn.LSTM",
    ),
    (
        "replace-transformer-layer",
        [SAFE, "+model=mlp", replace("TransformerEncoderLayer", d_model=100000, nhead=1)],
        "actions.r.with:",
        "TransformerEncoderLayer",
    ),
    (
        "replace-set-limit",
        ["limits.memory_gb=1", "+model=mlp", replace("Linear", in_features=M, out_features=M)],
        "actions.r.with:",
        "limits.memory_gb=1;",
    ),
    ("gpt2-n-embd", [SAFE, "+model=gpt2_tiny", "model.n_embd=100000"], "model:", "surgery.models.hf.gpt2_tiny"),
    ("gpt2-vocab", [SAFE, "+model=gpt2_tiny", f"model.vocab_size={1000 * M}"], "model:", "GB"),
    ("gpt2-n-layer", [SAFE, "+model=gpt2_tiny", "model.n_layer=100000"], "model:", "modules"),
    ("gpt2-n-positions", [SAFE, "+model=gpt2_tiny", f"model.n_positions={100 * M}"], "model:", "GB"),
    ("bert-intermediate", [SAFE, "+model=bert_tiny", f"model.intermediate_size={100 * M}"], "model:", "bert_tiny"),
    ("mlp-hidden", [SAFE, "+model=mlp", f"model.hidden={M}"], "model:", "surgery.models.mlp.MLP"),
    ("mlp-depth", [SAFE, "+model=mlp", "model.depth=100000"], "model:", "limits.count=10000"),
    ("input-random", [SAFE, "+model=mlp", "input.shape=[100000,100000]"], "input.shape:", "random input"),
    ("input-shapes", [SAFE, "+model=mlp", "+input.shapes=[[40000,40000],[40000,40000]]"], "input.shapes:", "GB"),
    ("input-float64", [SAFE, "+model=mlp", "dtype=float64", "input.shape=[30000,30000]"], "input.shape:", "GB"),
    ("input-tokens", [SAFE, "+model=gpt2_tiny", "input.shape=[100000,100000]"], "input.shape:", "tokens input"),
    ("digit-batch", [SAFE, "+model=cnn", "+input=digit", "input.shape=[1000000,1,280,28]"], "input.shape:", "digit"),
    ("digit-side", [SAFE, "+model=cnn", "+input=digit", "input.shape=[1,1,100000,100000]"], "input.shape:", "GB"),
    (
        "add-parameter",
        [SAFE, "+model=mlp", add("add_parameter", f"[{M}, {M}]")],
        "actions.p.shape:",
        "limits.memory_gb=3726",
    ),
    (
        "add-parameter-every-module",
        [SAFE, "+model=mlp", add("add_parameter", "[30000, 30000]", "type: Linear")],
        "actions.p.shape:",
        "4 × [30000, 30000]",
    ),
    ("add-buffer", [SAFE, "+model=mlp", add("add_buffer", "[100000, 100000]")], "actions.p.shape:", "GB"),
    # replacement modules that hold nothing and grow what they are given: measured on a meta twin before each call
    (
        "replace-upsample",
        [
            SAFE,
            "+model=cnn",
            "+input=random",
            "input.shape=[1,1,28,28]",
            replace("Upsample", "select: block1.act", scale_factor=1000),
        ],
        "actions.r.with:",
        "the output of Upsample on this input",
    ),
    (
        "replace-zeropad",
        [SAFE, "+model=mlp", replace("ZeroPad1d", "select: layers.0.act", padding=1000 * M)],
        "actions.r.with:",
        "the output of ZeroPad1d on this input",
    ),
    # sizes no tensor can have: one line without safe mode too
    ("shape-past-int64", ["+model=mlp", f"input.shape=[{10**20}]"], "input.shape:", "past 2**63-1"),
    ("shape-overflowing", ["+model=mlp", f"input.shape=[{10**10},{10**10},{10**10}]"], "input.shape:", "overflow"),
    # torch functions a config may name as fn: their output is measured on meta before each call
    ("fn-pad", [SAFE, "+model=mlp", partial("pad", "pad: [0, 1000000000]")], "actions.m.fn on module 'head':", "GB"),
    (
        "fn-interpolate",
        [SAFE, "+model=cnn", partial("interpolate", "scale_factor: 1000", "select: block1.conv")],
        "actions.m.fn on module 'block1.conv':",
        "the output of interpolate",
    ),
]


@pytest.mark.parametrize(("overrides", "starts", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bomb_is_one_line_naming_its_key_before_any_cost(
    overrides: list[str], starts: str, says: str, user_dir: Path, tmp_path: Path
) -> None:
    overrides = [o.replace("DIR", str(user_dir)) for o in overrides]
    message = refused(*overrides, out=tmp_path)
    assert message.startswith(starts.replace("DIR", str(user_dir))), message
    assert says in message, message
    bounded = any(o == SAFE or o.startswith("limits.memory_gb") for o in overrides)
    if bounded and starts.startswith(SIZED) and "modules" not in says and "count" not in says:
        # estimated before allocating, not the allocator failing
        assert "would need" in message and "more than limits.memory_gb=" in message, message


def test_the_red_team_table_is_at_least_50_cases() -> None:
    assert len(CASES) + 3 >= 50  # + the generate and allocator cases below


def test_generate_max_new_tokens_is_a_count(tmp_path: Path) -> None:
    from surgery.lm.generate import generate_both
    from surgery.lm.text import encode_prompts
    from tests.lm_helpers import tiny_gpt2, word_tokenizer

    tok = word_tokenizer(["the cat sat on the mat"])
    model = tiny_gpt2(len(tok), tok.eos_token_id)
    batch = encode_prompts(tok, prompt="the cat sat")
    clock = time.perf_counter()
    with enforced(SAFE_DEFAULTS), pytest.raises(ConfigError) as caught:
        generate_both(model, {}, batch, max_new_tokens=10**9, tokenizer=tok)
    assert time.perf_counter() - clock < SECONDS
    assert str(caught.value).startswith("generate.max_new_tokens: 1,000,000,000 new tokens are more than limits.count=")
    with pytest.raises(ConfigError, match=r"^generate.max_new_tokens: 21 new tokens .* limits.count=21$"):
        with enforced(Limits(count=20)):
            generate_both(model, {}, batch, max_new_tokens=21, tokenizer=tok)


def test_generate_max_new_tokens_within_the_count_runs(tmp_path: Path) -> None:
    from surgery.lm.generate import generate_both
    from surgery.lm.text import encode_prompts
    from tests.lm_helpers import tiny_gpt2, word_tokenizer

    tok = word_tokenizer(["the cat sat on the mat"])
    model = tiny_gpt2(len(tok), tok.eos_token_id)
    with enforced(Limits(count=3)):
        out = generate_both(model, {}, encode_prompts(tok, prompt="the cat sat"), max_new_tokens=3, tokenizer=tok)
    assert out is not None


# ---------------------------------------------------------------- raising the limit admits the same config


def _suggestion(message: str) -> str:
    """The ``limits.KEY=N`` a refusal ends with."""
    setting = message.rsplit("raise it: ", 1)[1]
    assert setting.startswith("limits.") and " " not in setting, message
    return setting


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "limits.memory_gb=0.001",
            "+model=mlp",
            "+actions.r={kind: replace_module, select: head, with: "
            "{_target_: torch.nn.Linear, in_features: 1000, out_features: 1000}}",
        ],
        [
            "limits.memory_gb=0.0001",
            "+model=mlp",
            "+actions.p={kind: add_parameter, select: head, name: big, shape: [300, 300]}",
        ],
        ["safe=true", "limits.memory_gb=0.001", "+model=mlp", "input.shape=[1000,1000]"],
        ["safe=true", "limits.count=10", "+model=mlp", "+input.batches=20"],
        ["safe=true", "limits.memory_gb=0.001", "+model=mlp", "model.hidden=1000"],
    ],
    ids=["replace-module", "add-parameter", "input-shape", "batches", "model"],
)
def test_pasting_the_suggested_limit_admits_the_same_config(overrides: list[str], tmp_path: Path) -> None:
    setting = _suggestion(refused("mode=plan", *overrides, out=tmp_path / "refused"))
    key = setting.split("=")[0]
    raised = [o for o in overrides if not o.startswith(key + "=")] + [setting]
    report = run_job(composed("mode=plan", *raised), tmp_path / "admitted")
    assert report["plan"] is not None


def test_a_model_measured_on_meta_first_is_built_bit_for_bit_as_without_limits() -> None:
    """The meta build restores every random state: limits never change a run's weights or fingerprints."""
    import torch

    from surgery.app.build import build_model, settings_of

    for model in ("mlp", "gpt2_tiny"):
        cfg: DictConfig = composed(f"+model={model}")
        settings = settings_of(cfg)
        states = []
        for limits in (SAFE_DEFAULTS, Limits()):
            torch.manual_seed(0)
            with enforced(limits):
                built = build_model(cfg.model, settings, torch.device("cpu"))
            states.append((built.state_dict(), torch.rand(3)))
        (first, after_first), (second, after_second) = states
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first), model
        assert torch.equal(after_first, after_second), model


# ---------------------------------------------------------------- the real command line: exit 2, one line


def test_cli_refuses_an_alias_bomb_from_a_config_dir_with_one_line(user_dir: Path, tmp_path: Path) -> None:
    clock = time.perf_counter()
    result = cli("--config-dir", str(user_dir), "+model=mlp", "+actions=laughs", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {user_dir / 'actions' / 'laughs.yaml'}, line "), lines
    assert time.perf_counter() - clock < 60


def test_cli_refuses_a_huge_replacement_and_the_pasted_suggestion_runs(tmp_path: Path) -> None:
    big = replace("Linear", in_features=16, out_features=4000)
    result = cli("safe=true", "limits.memory_gb=0.0001", "+model=mlp", "mode=plan", big, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: actions.r.with: would need"), lines
    setting = _suggestion(lines[0])
    again = cli("safe=true", setting, "+model=mlp", "mode=plan", big, cwd=tmp_path)
    assert again.returncode == 0, again.stderr


def test_cli_seed_beyond_64_bits_is_exit_2(tmp_path: Path) -> None:
    result = cli("+model=mlp", "seed=1000000000000000000000000000000", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: seed: 1000000000000000000000000000000 is out of range: a seed is an int from -2**63 to 2**63-1"
    ]


def test_generate_past_a_models_positions_is_a_config_error_without_limits_too() -> None:
    """safe=false: 10**9 new tokens on GPT-2 end at its n_positions with one line, not an IndexError inside."""
    from surgery.lm.generate import generate_both
    from surgery.lm.text import encode_prompts
    from tests.lm_helpers import tiny_gpt2, word_tokenizer

    tok = word_tokenizer(["the cat sat on the mat"])
    model = tiny_gpt2(len(tok), tok.eos_token_id)
    batch = encode_prompts(tok, prompt="the cat sat")
    with pytest.raises(ConfigError) as caught:
        generate_both(model, {}, batch, max_new_tokens=10**9, tokenizer=tok)
    assert str(caught.value) == (
        "generate.max_new_tokens: 1,000,000,000 new tokens after a 3-token prompt pass the model's 64 positions"
        " (n_positions); at most 61 here"
    )


def test_an_input_the_allocator_refuses_is_one_line_without_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """safe=false: a shape this machine cannot hold ends in one line naming input.shape, not a traceback."""
    import torch

    from surgery.app.inputs import make_inputs

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 80 GB\nmore"
        )

    monkeypatch.setattr(torch, "randn", refuse)
    with pytest.raises(
        ConfigError, match=r"^input\.shape: the input cannot be made here \(\[enforce fail.*80 GB\); check"
    ):
        make_inputs({"shape": [2, 3]}, 0, torch.float32, torch.device("cpu"))
