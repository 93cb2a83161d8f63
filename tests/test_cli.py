"""The command lines: compile dumps, hspmd-opt round trips and user passes, bad input."""

from __future__ import annotations

import os
import textwrap

from conftest import EXAMPLES, run_cli

MLP = os.path.join(EXAMPLES, "mlp.py")


def test_compile_dumps_three_levels_that_hspmd_opt_prints_unchanged(tmp_path):
    d = tmp_path / "bundle"
    run_cli("hspmd", "compile", MLP, "--strategy", "[0,1]: dp=2", "--dump-dir", str(d), check=True)
    names = sorted(os.listdir(d))
    assert names == ["annotated.mlir", "kernel_group0.mlir", "logical.mlir", "manifest.json", "physical_group0.mlir"]
    for name in names:
        if not name.endswith(".mlir"):
            continue
        text = (d / name).read_text()
        proc = run_cli("hspmd-opt", str(d / name), check=True)
        assert proc.stdout == text, f"{name} did not print back unchanged"
    physical = (d / "physical_group0.mlir").read_text()
    assert 'hspmd.devices = #dist.devices<"0,1">' in physical
    assert physical.count("comm.all_reduce") == 7  # the loss and six gradients
    # layouts survive only in global_type, for the runtime to cut its piece
    assert all("global_type" in line for line in physical.splitlines() if "#dist.layout" in line)


def test_kernel_level_prints_back_through_hspmd_opt(tmp_path):
    d = tmp_path / "bundle"
    run_cli("hspmd", "compile", MLP, "--emit", "kernels", "--dump-dir", str(d), check=True)
    text = (d / "kernel_group0.mlir").read_text()
    assert "kernel.fused" in text
    assert run_cli("hspmd-opt", str(d / "kernel_group0.mlir"), check=True).stdout == text


def test_compile_prints_a_level(tmp_path):
    proc = run_cli("hspmd", "compile", MLP, "--level", "logical", check=True)
    assert "graph.assign \"layers.0.weight\"" in proc.stdout
    assert "#dist.layout" not in proc.stdout


def test_opt_runs_a_pipeline_with_print_between_passes(tmp_path):
    d = tmp_path / "b"
    run_cli("hspmd", "compile", MLP, "--strategy", "[0,1]: dp=2", "--dump-dir", str(d), check=True)
    out = tmp_path / "out.mlir"
    proc = run_cli(
        "hspmd-opt", str(d / "annotated.mlir"), "-p", "specialize-groups,lower-reshard",
        "--print-between-passes", "-o", str(out), check=True,
    )
    assert "IR after specialize-groups" in proc.stdout
    lowered = out.read_text()
    assert "dist.reshard" not in lowered and lowered.count("comm.all_reduce") == 7
    assert 'builtin.module @group0 attributes {hspmd.devices = #dist.devices<"0,1">}' in lowered


USER_PASS = textwrap.dedent(
    '''
    """A user's pass: doubles every graph.scale factor."""
    from dataclasses import dataclass

    from xdsl.dialects.builtin import FloatAttr, Float64Type
    from xdsl.passes import ModulePass

    from hspmd.dialects import graph


    @dataclass(frozen=True)
    class DoubleScale(ModulePass):
        name = "double-scale"

        def apply(self, ctx, op):
            for o in op.walk():
                if isinstance(o, graph.ScaleOp):
                    o.properties["factor"] = FloatAttr(2 * o.factor.value.data, Float64Type())
    '''
)

SCALE_IR = textwrap.dedent(
    """\
    builtin.module {
      func.func @train_step() {
        %0 = graph.input "x" : tensor<4xf32>
        %1 = graph.scale %0 {factor = 1.500000e+00 : f64} : (tensor<4xf32>) -> tensor<4xf32>
        graph.output "y", %1 : tensor<4xf32>
        func.return
      }
    }
    """
)


def test_opt_loads_a_user_pass_from_a_file(tmp_path):
    (tmp_path / "my_passes.py").write_text(USER_PASS)
    (tmp_path / "in.mlir").write_text(SCALE_IR)
    proc = run_cli(
        "hspmd-opt", str(tmp_path / "in.mlir"), "--load-pass", str(tmp_path / "my_passes.py"), "-p", "double-scale",
        check=True,
    )
    assert "factor = 3.000000e+00" in proc.stdout


def test_opt_loads_a_user_pass_from_a_module(tmp_path):
    (tmp_path / "user_passes_mod.py").write_text(USER_PASS)
    (tmp_path / "in.mlir").write_text(SCALE_IR)
    proc = run_cli(
        "hspmd-opt", str(tmp_path / "in.mlir"), "--load-pass", "user_passes_mod", "-p", "double-scale,double-scale",
        check=True, env={"PYTHONPATH": str(tmp_path)},
    )
    assert "factor = 6.000000e+00" in proc.stdout


def test_hspmd_opt_subcommand_is_the_same_tool(tmp_path):
    (tmp_path / "in.mlir").write_text(SCALE_IR)
    proc = run_cli("hspmd", "opt", str(tmp_path / "in.mlir"), check=True)
    assert proc.stdout == SCALE_IR


# ----------------------------------------------------------------------------- bad input


def _fails(proc, *needles):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in proc.stderr, f"{n!r} not in:\n{proc.stderr}"


def test_malformed_ir_is_located(tmp_path):
    bad = tmp_path / "bad.mlir"
    bad.write_text(SCALE_IR.replace("tensor<4xf32>) ->", "tensor<4xf32> ->", 1))
    _fails(run_cli("hspmd-opt", str(bad)), f"{bad}:4:72: error: Expected ')'", "^")


def test_ir_that_fails_verification_names_the_op(tmp_path):
    bad = tmp_path / "bad.mlir"
    bad.write_text(SCALE_IR.replace("-> tensor<4xf32>", "-> tensor<5xf32>").replace('"y", %1 : tensor<4xf32>', '"y", %1 : tensor<5xf32>'))
    _fails(run_cli("hspmd-opt", str(bad)), "graph.scale")


def test_malformed_layout_in_ir_is_located(tmp_path):
    bad = tmp_path / "bad.mlir"
    bad.write_text(SCALE_IR.replace('%0 = graph.input "x" : tensor<4xf32>', '%0 = graph.input "x" : tensor<4xf32, #dist.layout<"[0,1]: split(0)=2 dup">>'))
    _fails(run_cli("hspmd-opt", str(bad)), f"{bad}:3:", "bad layout", "^")


def test_missing_files_and_unknown_passes(tmp_path):
    _fails(run_cli("hspmd-opt", str(tmp_path / "nope.mlir")), "no such file")
    (tmp_path / "in.mlir").write_text(SCALE_IR)
    _fails(run_cli("hspmd-opt", str(tmp_path / "in.mlir"), "-p", "no-such-pass"), "no-such-pass")
    _fails(run_cli("hspmd", "run", "-n", "1", str(tmp_path / "nope.py")), "no such model script")
    _fails(run_cli("hspmd-opt", str(tmp_path / "in.mlir"), "--load-pass", str(tmp_path / "x.py")), "no such file")


def test_malformed_strategy_shows_a_caret():
    proc = run_cli("hspmd", "compile", MLP, "--strategy", "[0,1]: dp=2 tq=1")
    _fails(proc, "tq", "^")


def test_strategy_that_does_not_match_n():
    # naming fewer ranks than -n leaves the others idle (tests/test_idle_ranks.py); naming more fails
    _fails(run_cli("hspmd", "run", "-n", "2", MLP, "--strategy", "[0-2]: dp=3", "--steps", "1"), "-n 2")


def test_shape_a_layout_cannot_split_names_tensor_shape_and_layout():
    proc = run_cli("hspmd", "compile", MLP, "--strategy", "[0-99]: dp=100")  # 64 rows for 100 ranks
    _fails(proc, "input 'x'", "(64, 64)", "split(0)=100")


def test_bundle_run_with_wrong_rank_count(tmp_path):
    d = tmp_path / "b"
    run_cli("hspmd", "compile", MLP, "--strategy", "[0,1]: dp=2", "--dump-dir", str(d), check=True)
    _fails(run_cli("hspmd", "run", "-n", "1", str(d)), "compiled for 2 devices")


def test_script_missing_parts(tmp_path):
    s = tmp_path / "m.py"
    s.write_text("config = {}\n")
    _fails(run_cli("hspmd", "compile", str(s)), "missing model, loss, batches")


def test_script_with_shape_error_names_its_line(tmp_path):
    src = open(MLP).read().replace('return hs.cross_entropy(model(batch["x"]), batch["y"])',
                                   'return hs.cross_entropy(batch["x"] @ batch["x"].T @ batch["x"], batch["y"][:3])')
    s = tmp_path / "m.py"
    s.write_text(src)
    proc = run_cli("hspmd", "compile", str(s))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{s}:" in proc.stderr


def test_a_run_leaves_no_bundle_behind(tmp_path):
    """`hspmd run` without --dump-dir compiles into a scratch directory that it removes when it
    ends (each run used to leave its bundle in the temporary directory)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    run_cli("hspmd", "run", "-n", "2", MLP, "--strategy", "[0,1]: dp=2", "--steps", "1", env=env, check=True)
    left = [p for p in scratch.iterdir() if p.name.startswith("hspmd-")]
    assert not left, left
