"""Level verifiers reject IR that does not belong to their level."""

from __future__ import annotations

import os

import pytest

from conftest import EXAMPLES
from hspmd.compiler import compile_script
from hspmd.frontend.script import load_script
from hspmd.dialects.context import module_text, parse_module
from hspmd.dialects.levels import LevelError, verify_annotated, verify_logical, verify_physical

ANNOTATED = """\
builtin.module {
  func.func @train_step() {
    %0 = graph.input "x" : tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>
    %1 = graph.parameter "w" {init = "zeros"} : tensor<4x4xf32, #dist.layout<"[0,1]: LW">>
    %2 = graph.matmul %0, %1 : (tensor<4x4xf32, #dist.layout<"[0,1]: split(0)=2">>, tensor<4x4xf32, #dist.layout<"[0,1]: LW">>) -> tensor<4x4xf32, #dist.layout<"[0,1]: LOUT">>
    func.return
  }
}
"""


def test_annotated_accepts_a_rule_abiding_matmul():
    verify_annotated(parse_module(ANNOTATED.replace("LW", "dup=2").replace("LOUT", "split(0)=2")))


def test_annotated_rejects_a_matmul_whose_layouts_break_its_rule():
    bad = parse_module(ANNOTATED.replace("LW", "split(0)=2").replace("LOUT", "split(0)=2"))
    with pytest.raises(LevelError, match="graph.matmul"):
        verify_annotated(bad)


def test_annotated_rejects_a_value_without_layout():
    text = ANNOTATED.replace("LW", "dup=2").replace("LOUT", "split(0)=2")
    text = text.replace('tensor<4x4xf32, #dist.layout<"[0,1]: dup=2">>', "tensor<4x4xf32>")
    with pytest.raises(LevelError, match="no layout"):
        verify_annotated(parse_module(text))


def test_each_level_accepts_its_own_and_rejects_the_next():
    compiled = compile_script(load_script(os.path.join(EXAMPLES, "mlp.py")), "[0,1]: dp=2", 2)
    verify_logical(compiled.logical)
    verify_annotated(compiled.annotated)
    verify_physical(compiled.physical)
    with pytest.raises(LevelError):
        verify_logical(compiled.annotated)
    with pytest.raises(LevelError):
        verify_physical(compiled.annotated)
    with pytest.raises(LevelError):
        verify_annotated(parse_module(module_text(compiled.logical)))
