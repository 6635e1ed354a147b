"""A model wrapped by nnsight gives the same numbers as the bare model (SPEC §20, issue 39).

``NNsight(model)`` replaces every module's ``forward`` with a controller taking ``(*args, **kwargs)``;
before, a study's patch picked the wrong input (``cannot pick item 'hidden_states' from a DynamicCache``).
Importing nnsight patches ``torch.Tensor.backward`` for the whole process (it then parses the source of
every caller), so the nnsight checks run in a child process of their own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import surgery
from surgery.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, torch, surgery, nnsight
from tests.lm_helpers import tiny_gpt2
PATCH = {"cap": {"kind": "capture", "select": "@resid_pre.{layer}"},
         "patch": {"kind": "modify_input", "select": "@resid_pre.{layer}", "op": "set", "index": "[:, {pos}]",
                   "from": {"capture": "cap"}}}
GRID, METRICS = {"layer": "0:2", "pos": "all"}, ["kl", {"prob": {"token": 3}}]
model = tiny_gpt2(20, 1)
ids = torch.randint(2, 20, (2, 5), generator=torch.Generator().manual_seed(0))
bare = surgery.study(model, PATCH, GRID, ids, METRICS, source=ids.flip(0))
wrapped = nnsight.NNsight(model)
same = [torch.equal(surgery.study(given, PATCH, GRID, ids, METRICS, source=ids.flip(0)).values["prob"],
                    bare.values["prob"]) for given in (wrapped, model)]  # the wrapper, and the model it changed
with torch.no_grad():
    before = model(ids).logits
    with surgery.apply(wrapped, {"z": {"kind": "modify_input", "select": "@mlp_out.0", "op": "zero"}}) as s:
        changed = model(ids).logits
    restored = torch.equal(model(ids).logits, before) and not torch.equal(changed, before) and s.model is model
print(json.dumps({"study": same, "apply": restored}))
"""


def test_a_study_and_an_apply_on_an_nnsight_wrapped_model_equal_the_bare_model() -> None:
    if importlib.util.find_spec("nnsight") is None:  # found, not imported: its import patches torch here too
        pytest.skip("the dev extra installs nnsight")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"study": [True, True], "apply": True}


def test_something_that_is_no_module_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^model: expected a torch.nn.Module, got str; pass the torch module"):
        surgery.plan("gpt2", {"c": {"kind": "capture", "select": "*"}})
