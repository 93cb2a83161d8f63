"""`hspmd compile --report` (collectives and their bytes) and `--explain` (where layouts came from)."""

from __future__ import annotations

import os
import textwrap

import pytest
from xdsl.dialects import func

from conftest import EXAMPLES, run_cli
from hspmd.compiler import annotate_with_provenance
from hspmd.dialects import comm
from hspmd.compiler import compile_script
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.dialects.context import module_text, parse_module
from hspmd.codegen.report import call_counts, collective_report, explain_rows, format_explain, format_report, value_names
from hspmd.dialects.levels import physical_groups

MLP = os.path.join(EXAMPLES, "mlp.py")
GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL_GPT = ["model.d_model=32", "model.seq_len=16", "data.batch_size=4"]


@pytest.fixture(scope="module")
def mlp():
    return compile_script(load_script(MLP), "[0,1]: dp=2", 2)


@pytest.fixture(scope="module")
def gpt():
    return compile_script(load_script(GPT, parse_overrides([*SMALL_GPT, "model.layers=3"])), "[0,1]: dp=2", 2)


def test_mlp_report_lists_the_loss_and_six_gradient_all_reduces(mlp):
    rows = collective_report(mlp.physical)
    assert len(rows) == 7
    assert {r.op for r in rows} == {"comm.all_reduce"}
    assert all(r.groups == ((0, 1),) and r.devices == (0, 1) and r.calls == 1 for r in rows)
    assert all(r.element_type == "f32" and r.function == "train_step" for r in rows)
    by_shape = {r.shape: r.bytes_per_call for r in rows}
    assert by_shape[()] == 4  # the loss: 2 * (2-1)/2 * 4 bytes
    assert by_shape[(64, 128)] == 2 * (2 - 1) // 2 * 64 * 128 * 4 == 32768
    assert by_shape[(128, 128)] == 65536
    # each row names the value as the printed IR does
    text = module_text(mlp.physical)
    for r in rows:
        assert f"{r.value} = comm.all_reduce" in text
    out = format_report(rows, mlp.physical)
    assert "device group [0, 1]" in out
    assert f"total: 7 collective calls per step (comm.all_reduce 7), {sum(r.bytes_per_step for r in rows):,} bytes" in out


def test_gpt_report_counts_calls_of_callees(gpt):
    physical = gpt.physical
    rows = collective_report(physical)
    params = [o for o in gpt.logical.walk() if o.name == "graph.parameter" and not o.tensor_name.data.startswith("opt.")]
    assert len(rows) == 1 + len(params)  # data parallel: the loss and each gradient, all in the step
    ((_, group),) = physical_groups(physical)
    assert call_counts(group) == {"train_step": 1, "Block_0_bwd": 3, "Block_0_fwd": 3}
    # a collective inside the repeated block counts once per layer
    fwd = next(f for f in group.body.block.ops if isinstance(f, func.FuncOp) and f.sym_name.data == "Block_0_fwd")
    arg = fwd.body.block.args[0]
    fwd.body.block.insert_op_before(comm.AllReduceOp(arg, [(0, 1)], arg.type), fwd.body.block.first_op)
    inner = [r for r in collective_report(physical) if r.function == "Block_0_fwd"]
    assert len(inner) == 1 and inner[0].calls == 3
    assert inner[0].bytes_per_step == 3 * inner[0].bytes_per_call == 3 * 32 * 4  # a [32] f32 weight, n=2


def test_gpt_tensor_parallel_collectives_inside_the_block_count_once_per_layer():
    compiled = compile_script(load_script(GPT, parse_overrides([*SMALL_GPT, "model.layers=3"])), "[0,1]: tp=2", 2)
    rows = collective_report(compiled.physical)
    inner = [r for r in rows if r.function in ("Block_0_fwd", "Block_0_bwd")]
    assert inner and all(r.calls == 3 for r in inner)  # three layers, one traced block
    reduces = [r for r in inner if r.op == "comm.all_reduce"]
    assert reduces
    for r in reduces:
        size = 4 if r.element_type == "f32" else 8
        for d in r.shape:
            size *= d
        assert r.bytes_per_call == 2 * (2 - 1) * size // 2 and r.bytes_per_step == 3 * r.bytes_per_call
    assert all(r.calls == 1 for r in rows if r.function == "train_step")


NESTED = textwrap.dedent("""\
    builtin.module {
      builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0-3">} {
        func.func @train_step() {
          %0 = graph.input "x" {global_type = tensor<16x8xf32>} : tensor<4x8xf32>
          %1 = func.call @outer(%0) : (tensor<4x8xf32>) -> tensor<4x8xf32>
          %2 = func.call @outer(%1) : (tensor<4x8xf32>) -> tensor<4x8xf32>
          %3 = comm.all_gather %2 {groups = #dist.groups<"{0-3}">, dim = 0 : i64} : tensor<4x8xf32> -> tensor<16x8xf32>
          %4 = comm.reduce_scatter %3 {groups = #dist.groups<"{0-3}">, dim = 0 : i64} : tensor<16x8xf32> -> tensor<4x8xf32>
          %5 = comm.all_to_all %4 {groups = #dist.groups<"{0-3}">, split_dim = 1 : i64, concat_dim = 0 : i64} : tensor<4x8xf32> -> tensor<16x2xf32>
          %6 = comm.local_split %3 {groups = #dist.groups<"{0-3}">, dim = 0 : i64} : tensor<16x8xf32> -> tensor<4x8xf32>
          %7 = comm.broadcast %6 {groups = #dist.groups<"{0-3}">, root = 0 : i64} : tensor<4x8xf32> -> tensor<4x8xf32>
          comm.send %7 {pairs = [array<i64: 0, 1>]} : tensor<4x8xf32>
          %8 = comm.recv {pairs = [array<i64: 0, 1>]} : tensor<4x8xf32>
          func.return
        }
        func.func private @outer(%0 : tensor<4x8xf32>) -> tensor<4x8xf32> {
          %1 = func.call @inner(%0) : (tensor<4x8xf32>) -> tensor<4x8xf32>
          %2 = func.call @inner(%1) : (tensor<4x8xf32>) -> tensor<4x8xf32>
          %3 = func.call @inner(%2) : (tensor<4x8xf32>) -> tensor<4x8xf32>
          func.return %3 : tensor<4x8xf32>
        }
        func.func private @inner(%0 : tensor<4x8xf32>) -> tensor<4x8xf32> {
          %1 = comm.all_reduce %0 {groups = #dist.groups<"[2,2]<=[4]">} : tensor<4x8xf32> -> tensor<4x8xf32>
          func.return %1 : tensor<4x8xf32>
        }
        func.func private @unused(%0 : tensor<4x8xf32>) -> tensor<4x8xf32> {
          %1 = comm.all_reduce %0 {groups = #dist.groups<"{0-3}">} : tensor<4x8xf32> -> tensor<4x8xf32>
          func.return %1 : tensor<4x8xf32>
        }
      }
    }
""")


def test_bytes_per_collective_kind_and_calls_through_calls():
    module = parse_module(NESTED)
    rows = {r.op: r for r in collective_report(module)}
    b = 4 * 8 * 4  # a 4x8 f32 buffer: 128 bytes
    assert rows["comm.all_reduce"].calls == 6  # 2 calls of @outer, each 3 calls of @inner; @unused never runs
    assert rows["comm.all_reduce"].groups == ((0, 1), (2, 3))
    assert rows["comm.all_reduce"].bytes_per_call == 2 * (2 - 1) * b // 2
    assert rows["comm.all_gather"].bytes_per_call == 3 * (4 * b) // 4  # (n-1)/n of the 16x8 result
    assert rows["comm.all_gather"].result_shape == (16, 8)
    assert rows["comm.reduce_scatter"].bytes_per_call == 3 * (4 * b) // 4  # (n-1)/n of the 16x8 input
    assert rows["comm.all_to_all"].bytes_per_call == 3 * b // 4
    assert rows["comm.local_split"].bytes_per_call == 0
    assert rows["comm.broadcast"].bytes_per_call == b
    assert rows["comm.send"].bytes_per_call == b and rows["comm.send"].groups == ((0, 1),)
    assert rows["comm.recv"].bytes_per_call == 0
    total = sum(r.bytes_per_step for r in collective_report(module))
    assert f"{total:,} bytes per rank per step" in format_report(collective_report(module))


def test_explain_names_strategy_forward_backward_and_reshard(mlp):
    annotated, provenance = annotate_with_provenance(mlp)
    assert module_text(annotated) == module_text(mlp.annotated)  # recording changes nothing
    rows = explain_rows(annotated, provenance)
    by_op = {}
    for r in rows:
        by_op.setdefault(r.op, []).append(r)
    assert all(r.why == "strategy" and r.layout == "[0,1]: dup=2" for r in by_op['graph.parameter "layers.0.weight"'])
    assert by_op['graph.input "x"'][0].why == "strategy" and by_op['graph.input "x"'][0].layout == "[0,1]: split(0)=2"
    assert by_op["graph.matmul"][0].why == "forward: graph.matmul rule"
    assert any(r.why.startswith("backward: needed by") for r in by_op["graph.constant"])
    assert all(r.why.startswith("reshard of %") for r in by_op["dist.reshard"])
    assert "-" not in {r.why for r in rows}
    # names as the printed annotated IR has them
    names = value_names(annotated)
    text = module_text(annotated)
    matmul = next(o for o in annotated.walk() if o.name == "graph.matmul")
    assert f"{names[matmul.results[0]]} = graph.matmul" in text
    assert f"{names[matmul.results[0]]} " in format_explain(rows)


def test_explain_lays_out_callee_arguments_and_call_results(gpt):
    annotated, provenance = annotate_with_provenance(gpt)
    assert module_text(annotated) == module_text(gpt.annotated)
    rows = explain_rows(annotated, provenance)
    assert {r.function for r in rows} == {"train_step", "Block_0_fwd", "Block_0_bwd"}
    assert rows[0].function == "train_step"
    fwd = [r for r in rows if r.function == "Block_0_fwd"]
    assert fwd[0].op == "argument" and fwd[0].why == "argument of @Block_0_fwd"
    calls = [r for r in rows if r.op == "graph.scan @Block_0_fwd"]  # the layers, stacked: one scan
    assert calls and all(r.why == "forward: graph.scan @Block_0_fwd returns" for r in calls)
    assert "-" not in {r.why for r in rows}


def test_cli_report_and_explain():
    proc = run_cli("hspmd", "compile", MLP, "--strategy", "[0,1]: dp=2", "--report", check=True)
    assert proc.stdout.count("comm.all_reduce  ") == 7
    assert "32,768" in proc.stdout
    proc = run_cli("hspmd", "compile", GPT, *(a for s in SMALL_GPT for a in ("--set", s)), "--strategy", "[0,1]: dp=2",
                   "--report", "--explain", check=True)
    # the loss, and each gradient's all-reduce: 5 plain parameters and 12 stacked ones (each of all layers)
    assert "total: 18 collective calls per step" in proc.stdout
    assert "@Block_0_fwd" in proc.stdout and "strategy" in proc.stdout and "forward: graph.matmul rule" in proc.stdout
    proc = run_cli("hspmd", "compile", MLP, "--explain", check=True)  # one device: no collectives, still layouts
    assert '%0     graph.parameter "layers.0.weight"  [0]: dup=1  strategy' in proc.stdout


TWO_CALLS = textwrap.dedent("""\
    builtin.module {
      func.func @train_step() {
        %0 = graph.parameter "w" {init = "zeros"} : tensor<8x8xf32>
        %1 = graph.input "x" : tensor<8x8xf32>
        %2 = func.call @f(%1) : (tensor<8x8xf32>) -> tensor<8x8xf32>
        %3 = func.call @f(%0) : (tensor<8x8xf32>) -> tensor<8x8xf32>
        %4 = graph.add %2, %3 : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
        graph.assign "w", %4 : tensor<8x8xf32>
        func.return
      }
      func.func private @f(%0 : tensor<8x8xf32>) -> tensor<8x8xf32> {
        %1 = graph.relu %0 : (tensor<8x8xf32>) -> tensor<8x8xf32>
        func.return %1 : tensor<8x8xf32>
      }
    }
""")


def test_propagate_equals_the_pass_and_explains_a_copied_callee():
    from xdsl.rewriter import Rewriter

    from hspmd.dialects.dist import with_layout
    from hspmd.ir.layout_text import parse_layout
    from hspmd.compiler import run_passes
    from hspmd.transforms.propagate_layouts import propagate

    module = parse_module(TWO_CALLS)
    for op in list(module.walk()):  # as apply-strategy would: w replicated, x split
        text = {"graph.parameter": "[0,1]: dup=2", "graph.input": "[0,1]: split(0)=2"}.get(op.name)
        if text:
            Rewriter.replace_value_with_new_type(op.results[0], with_layout(op.results[0].type, parse_layout(text)))
    by_pass = module.clone()
    provenance = propagate(module)
    run_passes(by_pass, "propagate-layouts")
    assert module_text(module) == module_text(by_pass)
    run_passes(module, "insert-reshard")
    rows = {(r.function, r.op): r.why for r in explain_rows(module, provenance)}
    assert rows["train_step", 'graph.parameter "w"'] == "strategy"
    assert rows["train_step", "func.call @f_l1"] == "forward: func.call @f_l1 returns"
    assert rows["f_l1", "argument"] == "argument of @f_l1"  # the call with other argument layouts: a copy
    assert rows["f_l1", "graph.relu"] == rows["f", "graph.relu"] == "forward: graph.relu rule"
