"""Bundles and checkpoints written before device sets were ranges still load and train alike.

`tests/fixtures/main-2efd235/` holds what main wrote at commit 2efd235 (`make.py` made them, from
the `gpt.py` beside them: examples/gpt.py as it was, before it read an `hs.data` dataset): two
bundles of a small GPT (`[0-3]: dp=2 tp=2` and `[0,1]: dp=2 share=3 | [2]: dp=1 share=1`), whose
manifests and physical programs list every device (`"devices": [0, 1]`, `hspmd.devices =
array<i64: ...>`, `groups = [array<i64: ...>, ...]`), a checkpoint of the first after 2 steps, and
the losses the bundles trained to. Today's runtime reads them, trains them to the same losses,
and resumes the old checkpoint under the old bundle and under a bundle compiled today.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from hspmd.codegen.bundle import read_manifest
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.devices import DeviceRange
from hspmd.runtime.checkpoint.manifest import read_manifest as read_checkpoint
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import CheckpointOptions, train

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "main-2efd235")
LOSSES = json.load(open(os.path.join(HERE, "losses.json")))
GPT = os.path.join(HERE, "gpt.py")  # examples/gpt.py at 2efd235 (its data: lm_windows)
SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=8",
         "optim.warmup=2", "steps=4"]


def _copy(tmp_path, name: str) -> str:
    """Return a copy of fixture bundle `name` whose manifest names the fixture's gpt.py (the bundle
    names the path it was made at; nothing else changes)."""
    dest = tmp_path / name
    shutil.copytree(os.path.join(HERE, name), dest)
    manifest = dest / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["script"] = GPT
    manifest.write_text(json.dumps(raw, indent=2))
    return str(dest)


def _train(bundle: str, n: int, steps: int = 4, **options):
    return run_spmd(n, lambda comm: train(bundle, comm, steps=steps, quiet=True,
                                          checkpoints=CheckpointOptions(**options)), timeout=300)[0]


def test_an_old_manifest_reads_its_listed_devices_as_ranges(tmp_path):
    m = read_manifest(_copy(tmp_path, "bundle-gpt-hetero-dp"))
    assert [g.devices for g in m.groups] == [DeviceRange.iota(2), DeviceRange(2)]
    assert m.group_for(2).program == "physical_group1.mlir"
    text = open(os.path.join(HERE, "bundle-gpt-dp2tp2", "physical_group0.mlir")).read()
    assert "hspmd.devices = array<i64: 0, 1, 2, 3>" in text and "groups = [array<i64:" in text  # really old


@pytest.mark.parametrize("name,n", [("bundle-gpt-dp2tp2", 4), ("bundle-gpt-hetero-dp", 3)])
def test_an_old_bundle_trains_to_its_losses(tmp_path, name, n):
    got = _train(_copy(tmp_path, name), n)
    np.testing.assert_allclose(got.losses, LOSSES[name.removeprefix("bundle-")], rtol=1e-6)


def test_an_old_checkpoint_resumes_under_the_old_bundle_and_a_new_one(tmp_path):
    ck = os.path.join(HERE, "checkpoint-gpt-dp2tp2")
    assert read_checkpoint(os.path.join(ck, "step-2")).tensors["wte.weight"].layout.startswith("[0-3]")
    want = LOSSES["gpt-dp2tp2"][2:]
    old = _train(_copy(tmp_path, "bundle-gpt-dp2tp2"), 4, resume=ck)
    assert old.first_step == 3
    np.testing.assert_allclose(old.losses, want, rtol=1e-6)
    new = str(tmp_path / "new")
    write_bundle(compile_script(load_script(GPT, parse_overrides(SMALL)),
                                "[0,1]: tp=2", 2), new)
    resharded = _train(new, 2, resume=ck)
    np.testing.assert_allclose(resharded.losses, want, rtol=1e-4)
