"""`hspmd reduce` and `hspmd compare` (issue 42): a planted bug shrinks to a handful of ops, every
candidate the reducer tries is valid IR, annotated IR loses device groups and stages, and the
random-model sweep saves the reduced case of a failure."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hspmd.cli.compare import DIFFER_EXIT, compare_ir
from hspmd.cli.main import main
from hspmd.cli.reduce import reduce_ir
from hspmd.dialects.context import module_text, parse_module
from hspmd.transforms.reduce_steps import count_ops

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")

#: the planted bug: a user pass that miscompiles one op kind (graph.relu computes x/2: no clamp)
WRONG_RELU = '''
from dataclasses import dataclass
from xdsl.passes import ModulePass
from hspmd.dialects import graph


@dataclass(frozen=True)
class WrongRelu(ModulePass):
    name = "wrong-relu"

    def apply(self, ctx, op):
        for o in list(op.walk()):
            if isinstance(o, graph.ReluOp):
                wrong = graph.ScaleOp(o.input, 0.5)
                o.parent_block().insert_op_before(wrong, o)
                o.result.replace_all_uses_with(wrong.result)
                o.detach()
                o.erase()
'''


@pytest.fixture(scope="module")
def wrong_relu(tmp_path_factory):
    """Return a PassManager that runs the planted bug after lower-reshard, and its file."""
    from hspmd.cli.opt import load_user_passes
    from hspmd.transforms.pass_manager import PassManager
    from hspmd.transforms.pass_pipeline import Insertion, PipelineEdits

    path = tmp_path_factory.mktemp("passes") / "wrong_relu.py"
    path.write_text(WRONG_RELU)
    edits = PipelineEdits(load_user_passes(str(path)), {}, (Insertion("lower-reshard", "wrong-relu"),))
    return PassManager(edits=edits), str(path)


def level_text(capsys, level: str, strategy: str = "[0,1]: dp=2") -> str:
    assert main(["compile", MLP, "--strategy", strategy, "--level", level]) == 0
    return capsys.readouterr().out


def test_compare_says_same_for_hspmd_and_differ_for_a_planted_bug(capsys, tmp_path, wrong_relu):
    logical = parse_module(level_text(capsys, "logical"))
    assert compare_ir(logical, "[0,1]: dp=2").code == 0
    verdict = compare_ir(logical, "[0,1]: dp=2", passes=wrong_relu[0])
    assert verdict.code == DIFFER_EXIT and verdict.line.startswith("differ: step 1, output 'loss'")
    annotated = tmp_path / "annotated.mlir"
    annotated.write_text(level_text(capsys, "annotated", "[0-3]: dp=2 tp=2"))
    assert main(["compare", str(annotated)]) == 0
    assert "same: 4 ranks under '[0-3]: dp=2 tp=2'" in capsys.readouterr().out
    assert main(["compare", str(annotated), "--load-pass", wrong_relu[1],
                 "--pass-after", "lower-reshard=wrong-relu"]) == DIFFER_EXIT
    assert capsys.readouterr().err.startswith("differ: ")
    assert main(["compare", str(annotated), "--strategy", "[0,1]: dp=2"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "records its strategy" in err


def test_reduce_shrinks_a_planted_miscompile_to_at_most_ten_ops(capsys, wrong_relu):
    """The done criterion: a user pass that miscompiles graph.relu; `hspmd compare` finds the MLP's
    training step wrong; the reducer keeps the smallest step on which it is still wrong."""
    manager = wrong_relu[0]
    logical = parse_module(level_text(capsys, "logical"))
    tried: list[str] = []

    def interesting(module, text: str) -> bool:  # as `hspmd compare {} ...; test $? = 4`
        tried.append(text)
        try:
            return compare_ir(module, "[0,1]: dp=2", passes=manager).code == DIFFER_EXIT
        except Exception:  # an internal error, a refusal: another exit code
            return False

    result = reduce_ir(logical, interesting)
    assert result.ops_before == count_ops(logical) > 50
    assert result.ops_after <= 10, result.text
    assert "graph.relu" in result.text and result.tests == len(tried)
    small = parse_module(result.text)
    assert compare_ir(small, "[0,1]: dp=2", passes=manager).code == DIFFER_EXIT
    assert compare_ir(small, "[0,1]: dp=2").code == 0  # without the planted bug: the same numbers
    for text in tried:  # every candidate the test saw was valid logical IR
        from hspmd.dialects.levels import verify_logical

        verify_logical(parse_module(text))


def test_reduce_on_annotated_ir_drops_device_groups_and_shrinks_shapes(capsys):
    annotated = parse_module(level_text(capsys, "annotated", "[0,1]: dp=2 share=1 | [2]: dp=1 share=1"))

    def interesting(module, text: str) -> bool:  # a crash-like bug: wherever a relu_grad is compiled
        return "graph.relu_grad" in text

    result = reduce_ir(annotated, interesting)
    from hspmd.dialects.dist import module_strategies
    from hspmd.dialects.levels import verify_annotated

    small = parse_module(result.text)
    verify_annotated(small)
    assert str(module_strategies(small)[0].strategy) == "[0]: dp=1"
    # the relu_grad and what keeps it alive: a gradient's reduction, its update and assign, and constants
    assert result.ops_after <= 8 and "graph.relu_grad" in result.text
    assert "tensor<1x1xf32" in result.text  # the dims halved down to 1


def test_reduce_command_line_runs_the_test_command_and_writes_the_smallest_file(capsys, tmp_path):
    step = tmp_path / "step.mlir"
    step.write_text(level_text(capsys, "logical"))
    out = tmp_path / "small.mlir"
    # interesting while the program still computes the loss's cross-entropy (a crash in it, say)
    test = f"{sys.executable} -c \"import sys; sys.exit('softmax_cross_entropy %' not in open(sys.argv[1]).read())\""
    assert main(["reduce", str(step), "--test", test, "-o", str(out)]) == 0
    text = out.read_text()
    report = capsys.readouterr().out
    assert "softmax_cross_entropy %" in text and count_ops(parse_module(text)) <= 5, text
    assert report.splitlines()[-1].startswith("hspmd reduce: 59 ops -> ") and str(out) in report
    assert main(["reduce", str(step), "--test", "false"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "must exit 0 on the input itself" in err
    assert main(["reduce", str(step), "--test", "grep -q graph.relu {}", "--max-tests", "3"]) == 0
    assert os.path.isfile(tmp_path / "step.reduced.mlir") and "stopped after --max-tests 3" in capsys.readouterr().out


def test_the_sweep_saves_the_reduced_case_of_a_failure(tmp_path, wrong_relu):
    sys.path.insert(0, str(ROOT / "tools"))
    from random_model_sweep import reduce_failure

    from generated_model import DEFAULT_SPEC
    from models import Parallel, Reference

    spec = {**DEFAULT_SPEC, "layers": 1, "mlp": "relu", "d_model": 8, "heads": 2, "head_dim": 4, "d_ff": 8, "seq": 4,
            "batch": 4, "vocab": 16, "function": False, "final_norm": False}
    line = reduce_failure(Reference(spec), Parallel("[0,1]: tp=2", 2), "numpy", str(tmp_path), wrong_relu[0])
    case = tmp_path / "case-0"
    assert "reduced to" in line and str(case / "reduced.mlir") in line
    logical, reduced = (parse_module((case / f).read_text()) for f in ("logical.mlir", "reduced.mlir"))
    assert count_ops(reduced) <= 10 < count_ops(logical)
    assert "hspmd reduce" in (case / "again.sh").read_text() and "test $? = 4" in (case / "again.sh").read_text()
    assert module_text(reduced) == (case / "reduced.mlir").read_text()
