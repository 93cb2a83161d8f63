"""`hs.annotate`: a user's layout on any value wins, the rest is laid out around it, and the
program still computes the 1-device numbers."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hspmd.dialects import dist
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.strategy import parse_strategy
from hspmd.frontend.tracing import TraceError
from hspmd.codegen.report import collective_report
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train
from hspmd.transforms.apply_annotations import spec_layout
from hspmd.transforms.util import PassError

from conftest import run_cli

SCRIPT = os.path.join(os.path.dirname(__file__), "mpi_scripts", "annotated_mlp.py")


def _compile(annotate: str, strategy: str, n: int, hidden: int = 16):
    overrides = parse_overrides([f"annotate={annotate}", f"hidden={hidden}"])
    return compile_script(load_script(SCRIPT, overrides), strategy, n)


def _losses(tmp_path, annotate: str, strategy: str, n: int) -> list[float]:
    bundle = tmp_path / f"b{n}-{abs(hash((annotate, strategy)))}"
    write_bundle(_compile(annotate, strategy, n), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=3, quiet=True), timeout=120)[0].losses


def test_spec_layouts_follow_the_mesh_of_each_group():
    assert str(spec_layout(parse_strategy("[0-3]: dp=2 tp=2"), ("dp", "tp"))) == "[0-3]: split(0)=2, split(1)=2"
    assert str(spec_layout(parse_strategy("[0-3]: dp=2 tp=2"), ("tp", "dp"))) == "[0-3]: split(1)=2, split(0)=2"
    assert str(spec_layout(parse_strategy("[0-3]: dp=2 tp=2"), ("", ""))) == "[0-3]: dup=4"
    assert str(spec_layout(parse_strategy("[0,1]: dp=2 share=3 | [2]: dp=1"), ("", "dp"))) == \
        "[0,1]: split(1)=2 | [2]: dup=1 ; hetero=split(1), shares=3:1"
    assert str(spec_layout(parse_strategy("[0,1]: tp=2 | [2]: tp=1"), ("", "tp"))) == \
        "[0,1]: split(1)=2 | [2]: dup=1 ; hetero=dup"


def test_the_logical_ir_holds_the_annotation_and_its_gradients():
    compiled = _compile("dp,tp", "[0-3]: dp=2 tp=2", 4)
    annotations = [o for o in compiled.logical.walk() if isinstance(o, dist.AnnotateOp)]
    assert [o.axes() for o in annotations] == [("dp", "tp"), ("dp", "tp")]  # the value and its gradient
    assert not any(isinstance(o, dist.AnnotateOp) for o in compiled.annotated.walk())


@pytest.mark.parametrize("annotate,strategy,n", [
    ("dp,tp", "[0-3]: dp=2 tp=2", 4),
    ("dp,-", "[0-3]: dp=2 tp=2", 4),      # against the Megatron split: gathered over tp
    ("tp,dp", "[0-3]: dp=2 tp=2", 4),     # batch over tp, features over dp
    ("-,-", "[0,1]: dp=2", 2),            # replicated everywhere
    ("[0,1]: split(1)=2", "[0,1]: dp=2", 2),
    ("dp,-", "[0,1]: dp=2 share=3 | [2]: dp=1", 3),
])
def test_annotated_programs_compute_the_one_device_losses(tmp_path, annotate, strategy, n):
    ref = _losses(tmp_path, annotate if ":" not in annotate else "-,-", "[0]: dp=1", 1)
    got = _losses(tmp_path, annotate, strategy, n)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_an_annotation_changes_the_communication():
    megatron = collective_report(_compile("dp,tp", "[0-3]: dp=2 tp=2", 4).physical)
    gathered = collective_report(_compile("dp,-", "[0-3]: dp=2 tp=2", 4).physical)
    assert not any(r.op == "comm.all_gather" for r in megatron)
    assert any(r.op == "comm.all_gather" and tuple(map(tuple, r.groups)) == ((0, 1), (2, 3)) for r in gathered)


def test_bad_annotations_say_what_and_where():
    with pytest.raises(TraceError, match=r"annotated_mlp.py:\d+: annotate: spec \['dp'\] has 1 entries"):
        _compile("dp", "[0,1]: dp=2", 2)
    with pytest.raises(TraceError, match="names 'pp'; the mesh axes are dp, tp"):
        _compile("pp,-", "[0,1]: dp=2", 2)
    with pytest.raises(TraceError, match="names 'dp' twice"):
        _compile("dp,dp", "[0,1]: dp=2", 2)
    with pytest.raises(PassError, match=r"over other devices than the strategy"):
        _compile("[0-3]: split(1)=4", "[0,1]: dp=2", 2)
    with pytest.raises(PassError, match=r"shape \[8, 15\] annotated spec \[None, 'dp'\] .*cannot be laid out"):
        _compile("-,dp", "[0,1]: dp=2", 2, hidden=15)


def test_cli_reports_a_bad_annotation_in_one_line(tmp_path):
    proc = run_cli("hspmd", "compile", SCRIPT, "--set", "annotate=pp,-", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "names 'pp'" in proc.stderr
