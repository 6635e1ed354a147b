"""A checkpoint loaded through ``on_load`` hooks into a tied GPT-2 (issue 25: ``+model=hf model.checkpoint=...``
plus any on_load action was exit 1, ``Missing key(s): lm_head.weight``): ``save_pretrained`` omits the tied
``lm_head.weight``, and the late load forgives it as the load without on_load does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file, save_file  # noqa: E402

from surgery.app.job import run_job  # noqa: E402
from surgery.errors import ConfigError  # noqa: E402
from tests.lm_helpers import tiny_gpt2, word_tokenizer  # noqa: E402
from tests.test_cli import composed  # noqa: E402

ADD_AND_LOAD = (  # an added parameter the checkpoint does not have, forgiven by on_load
    "+actions.extra={kind: add_parameter, select: transformer.h.0.mlp, name: extra, shape: [1]}",
    "+actions.load={kind: on_load}",
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny GPT-2 with its tokenizer, and another one's weights (seed 1) as save_pretrained writes them."""
    root = tmp_path_factory.mktemp("tied")
    tok = word_tokenizer(["the cat sat on the mat", "the dog ran in the park"])
    tiny_gpt2(len(tok), tok.eos_token_id).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    tiny_gpt2(len(tok), tok.eos_token_id, seed=1).save_pretrained(root / "other")
    assert "lm_head.weight" not in load_file(str(root / "other" / "model.safetensors"))  # tied, so omitted
    return root / "model", root / "other" / "model.safetensors"


def test_a_tied_checkpoint_loads_through_on_load_as_it_loads_without(saved: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, checkpoint = saved
    base = ("+model=hf", f"model.path={model_dir}", f"model.checkpoint={checkpoint}")
    late = run_job(composed(*base, *ADD_AND_LOAD), tmp_path / "late")
    early = run_job(composed(*base), tmp_path / "early")
    plain = run_job(composed("+model=hf", f"model.path={model_dir}"), tmp_path / "plain")
    got, want = (load_file(str(tmp_path / run / "output.safetensors")) for run in ("late", "early"))
    assert torch.equal(got["output/logits"], want["output/logits"])  # the checkpoint's weights, lm_head tied to wte
    assert late["fingerprints"]["output"] == early["fingerprints"]["output"] != plain["fingerprints"]["output"]


def test_a_checkpoint_missing_a_real_key_is_a_config_error_naming_it(saved: tuple[Path, Path], tmp_path: Path) -> None:
    model_dir, checkpoint = saved
    state = load_file(str(checkpoint))
    del state["transformer.h.1.mlp.c_fc.weight"]
    save_file(state, str(tmp_path / "short.safetensors"))
    short = f"model.checkpoint={tmp_path / 'short.safetensors'}"
    cfg = composed("+model=hf", f"model.path={model_dir}", short, *ADD_AND_LOAD)
    with pytest.raises(ConfigError, match=r"^model\.checkpoint: .*missing keys: transformer\.h\.1\.mlp\.c_fc\.weight"):
        run_job(cfg, tmp_path / "run")
