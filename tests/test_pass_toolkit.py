"""The compiler as a toolkit (issue 42): the pipeline as text, the user's passes in it, the IR
after each pass, pass timings; on `hspmd compile`, `hspmd run`, `hspmd plan` and `hspmd-opt`.

The commands run in process (`hspmd.cli.main.main`, `hspmd.cli.opt.main`) on the digits MLP,
except the byte-for-byte check, which runs the shell command the issue names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hspmd.cli.main import main
from hspmd.cli.opt import main as opt_main

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "mlp.py")
DP2 = "[0,1]: dp=2"

USER_PASSES = '''
from dataclasses import dataclass
from xdsl.dialects.builtin import FloatAttr, Float64Type, TensorType, NoneAttr
from xdsl.passes import ModulePass
from hspmd.dialects import graph


@dataclass(frozen=True)
class DoubleScale(ModulePass):
    name = "double-scale"
    times: float = 2.0

    def apply(self, ctx, op):
        for o in op.walk():
            if isinstance(o, graph.ScaleOp):
                o.properties["factor"] = FloatAttr(self.times * o.factor.value.data, Float64Type())


@dataclass(frozen=True)
class BreakIr(ModulePass):
    name = "break-ir"

    def apply(self, ctx, op):
        for o in op.walk():
            if isinstance(o, graph.ScaleOp) and o.results[0].uses:
                o.detach()
                return


@dataclass(frozen=True)
class Raises(ModulePass):
    name = "raises"

    def apply(self, ctx, op):
        raise ValueError("this pass has a bug")


@dataclass(frozen=True)
class DropLayouts(ModulePass):
    """Breaks the annotated level's rule (every value has a layout) but not the ops' verifiers."""
    name = "drop-layouts"

    def apply(self, ctx, op):
        from xdsl.rewriter import Rewriter
        for o in list(op.walk()):
            if isinstance(o, graph.InputOp):
                t = o.result.type
                Rewriter.replace_value_with_new_type(o.result, TensorType(t.element_type, t.get_shape(), NoneAttr()))
'''


@pytest.fixture
def passes_file(tmp_path) -> str:
    path = tmp_path / "my_passes.py"
    path.write_text(USER_PASSES)
    return str(path)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Return (exit code, stdout, stderr) of `hspmd ARGV` run in process (a SystemExit's message is
    what the command line prints)."""
    try:
        code = main(list(argv))
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *words: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1, err
    assert len(lines) == 1 and lines[0].startswith("hspmd: error: ") and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------- the pipeline as text


def test_print_pipeline_lists_every_level_and_one_level_alone(capsys):
    code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--print-pipeline")
    assert code == 0
    levels = dict(line.split(": ", 1) for line in out.splitlines() if not line.startswith("//"))
    assert levels == {"logical": "stack-layers,autodiff,sgd{lr=0.3}",
                      "annotated": 'apply-strategy{strategy="[0,1]: dp=2"},apply-annotations{strategy_id=0},'
                                   "propagate-layouts,insert-reshard,reuse-resharded-residuals",
                      "physical": "specialize-groups,lower-reshard", "kernel": "fuse-kernels",
                      "device": "device-kernels,flash-attention,multi-tensor"}
    code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", "[0-3]: pp=2 dp=2", "--print-pipeline",
                           "--level", "physical")
    assert code == 0 and out == ("specialize-groups,lower-reshard,cut-stacked-layers{strategy_id=0 group=0},"
                                 "assign-pipeline-stages{strategy_id=0 group=0},"
                                 "outline-pipeline-stages{strategy_id=0 group=0},coalesce-group-sums\n")


def test_hspmd_opt_with_the_printed_physical_pipeline_writes_what_compile_writes(tmp_path):
    """The issue's command, in a shell: `hspmd-opt -p "$(hspmd compile SCRIPT --print-pipeline
    --level physical)"` on the annotated IR gives `hspmd compile`'s physical IR, byte for byte."""
    bin_dir = os.path.dirname(sys.executable)
    script = f"""set -euo pipefail
S='{DP2}'
hspmd compile {MLP} --strategy "$S" --level annotated > {tmp_path}/annotated.mlir
hspmd compile {MLP} --strategy "$S" --level physical > {tmp_path}/compiled.mlir
hspmd-opt {tmp_path}/annotated.mlir -p "$(hspmd compile {MLP} --strategy "$S" --print-pipeline --level physical)" \\
  > {tmp_path}/opt.mlir
"""
    env = {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    compiled = (tmp_path / "compiled.mlir").read_bytes()
    assert b"comm.all_reduce" in compiled
    assert (tmp_path / "opt.mlir").read_bytes() == compiled


def test_pipeline_text_reproduces_every_level_of_a_pipelined_compile(capsys, tmp_path):
    """Each level's printed pass list, run by hspmd-opt on the level before, gives compile's level
    (a pipeline of two stages: the stage passes carry their options)."""
    s = "[0-3]: pp=2 dp=2"
    levels = {}
    for level in ("logical", "annotated", "physical"):
        code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", s, "--level", level)
        assert code == 0
        levels[level] = out
        (tmp_path / f"{level}.mlir").write_text(out)
    for below, level in (("logical", "annotated"), ("annotated", "physical")):
        code, text, _ = run_cli(capsys, "compile", MLP, "--strategy", s, "--print-pipeline", "--level", level)
        assert code == 0
        assert opt_main([str(tmp_path / f"{below}.mlir"), "-p", text.strip()]) == 0
        assert capsys.readouterr().out == levels[level]


def test_pipeline_flag_replaces_levels_from_text_or_a_file(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--print-pipeline")
    (tmp_path / "pipeline.txt").write_text(out.replace("sgd{lr=0.3}", "sgd{lr=0.5}"))
    code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--level", "logical",
                           "--pipeline", f"@{tmp_path / 'pipeline.txt'}")
    assert code == 0 and "graph.constant {value = 5.000000e-01 : f64} : tensor<f64>" in out
    code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--level", "logical",
                           "--pipeline", "autodiff,sgd{lr=0.25 momentum=0.9}")  # a bare list: the --level's
    assert code == 0 and "2.500000e-01" in out and "momentum = 9.000000e-01" in out
    code, _, err = run_cli(capsys, "compile", MLP, "--pipeline", "physical: specialize-groups,no-such-pass")
    one_line_error(code, err, "no-such-pass", "--pipeline")
    code, _, err = run_cli(capsys, "compile", MLP, "--pipeline", "physical: lower-reshard{bogus=1}")
    one_line_error(code, err, "--pipeline")
    code, _, err = run_cli(capsys, "compile", MLP, "--pipeline", f"@{tmp_path / 'missing.txt'}")
    assert code != 0 and "missing.txt" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- your own passes


def test_pass_after_and_before_insert_at_every_named_point_in_order(capsys, passes_file):
    base = ("compile", MLP, "--strategy", DP2, "--load-pass", passes_file, "--print-pipeline", "--level", "physical")
    code, out, _ = run_cli(capsys, *base, "--pass-after", "lower-reshard=double-scale{times=3.0}",
                           "--pass-before", "lower-reshard=double-scale",
                           "--pass-after", "double-scale=break-ir")  # a later insertion names an earlier one's pass
    assert code == 0
    assert out.strip() == ("specialize-groups,double-scale,break-ir,lower-reshard,double-scale{times=3.0},break-ir")
    code, _, err = run_cli(capsys, *base, "--pass-after", "no-such-anchor=double-scale")
    one_line_error(code, err, "--pass-after no-such-anchor=double-scale", "no pass 'no-such-anchor'")
    code, _, err = run_cli(capsys, *base, "--pass-after", "lower-reshard=not-loaded")
    one_line_error(code, err, "not-loaded")
    code, _, err = run_cli(capsys, *base, "--pass-before", "lower-reshard")
    one_line_error(code, err, "NAME=PASS")
    code, _, err = run_cli(capsys, "compile", MLP, "--load-pass", "/nonexistent/passes.py")
    one_line_error(code, err, "--load-pass", "no such file")


def test_a_loaded_pass_changes_what_compiles(capsys, passes_file):
    code, plain, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2)
    code, doubled, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--load-pass", passes_file,
                               "--pass-after", "lower-reshard=double-scale")
    assert code == 0 and "factor = 1.562500e-02" in plain and "factor = 3.125000e-02" in doubled
    assert "factor = 1.562500e-02" not in doubled


def test_a_pass_that_breaks_the_ir_is_one_line_naming_it_and_the_op_with_the_ir_in_files(capsys, passes_file):
    code, _, err = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--load-pass", passes_file,
                           "--pass-after", "lower-reshard=break-ir")
    line = one_line_error(code, err, "your pass break-ir broke the IR", "'comm.all_reduce'", "'graph.scale'")
    before, after = line.split("IR before it: ")[1].rstrip(")").split(", after it: ")
    assert "graph.scale" in open(before).read() and "break-ir" in open(after).read()
    code, _, err = run_cli(capsys, "compile", MLP, "--load-pass", passes_file, "--pass-after", "autodiff=raises")
    one_line_error(code, err, "your pass raises raised ValueError: this pass has a bug")


def test_a_user_pass_breaking_a_level_rule_is_the_users_not_an_internal_error(capsys, passes_file):
    code, _, err = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--load-pass", passes_file,
                           "--pass-after", "reuse-resharded-residuals=drop-layouts")
    one_line_error(code, err, "drop-layouts", "verify-annotated")


def test_a_bundle_records_the_user_passes_and_run_says_so(capsys, passes_file, tmp_path):
    bundle = tmp_path / "bundle"
    code, _, _ = run_cli(capsys, "compile", MLP, "--strategy", "[0]: dp=1", "--dump-dir", str(bundle),
                         "--load-pass", passes_file, "--pass-after", "lower-reshard=double-scale")
    assert code == 0
    record = json.loads((bundle / "manifest.json").read_text())["user_passes"]
    digest = __import__("hashlib").sha256(open(passes_file, "rb").read()).hexdigest()
    assert record == {"ran": ["double-scale"], "placed": ["--pass-after lower-reshard=double-scale"],
                      "sources": [{"source": passes_file, "sha256": digest,
                                   "passes": ["break-ir", "double-scale", "drop-layouts", "raises"]}]}
    code, _, err = run_cli(capsys, "run", "-n", "1", str(bundle), "--steps", "1")
    assert code == 0 and f"bundle {bundle} was compiled with your passes: double-scale placed by --pass-after " \
                         f"lower-reshard=double-scale; from {passes_file} (sha256 {digest[:12]})" in err
    with open(passes_file, "a") as f:
        f.write("\n# edited\n")
    code, _, err = run_cli(capsys, "run", "-n", "1", str(bundle), "--steps", "1")
    assert code == 0 and "changed since" in err
    code, _, err = run_cli(capsys, "run", "-n", "1", str(bundle), "--load-pass", passes_file)
    assert code != 0 and "apply to scripts only" in err
    code, _, _ = run_cli(capsys, "compile", MLP, "--dump-dir", str(tmp_path / "plain"))
    assert "user_passes" not in json.loads((tmp_path / "plain" / "manifest.json").read_text())


def test_run_with_a_loaded_pass_trains_what_it_compiled(capsys, passes_file, tmp_path):
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    assert run_cli(capsys, "run", "-n", "1", MLP, "--steps", "2", "--log", str(logs[0]))[0] == 0
    code, _, err = run_cli(capsys, "run", "-n", "1", MLP, "--steps", "2", "--log", str(logs[1]),
                           "--load-pass", passes_file, "--pass-after", "lower-reshard=double-scale")
    assert code == 0 and "compiled with your passes: double-scale" in err
    a, b = ([json.loads(line)["loss"] for line in open(p)] for p in logs)
    assert a != b and abs(b[0] - 2 * a[0]) < 1e-4 * a[0]  # the loss's scale doubled


def test_plan_compiles_its_candidates_with_the_users_passes(capsys, passes_file):
    code, out, err = run_cli(capsys, "plan", MLP, "-n", "2", "--top", "1", "--load-pass", passes_file,
                             "--pass-after", "lower-reshard=break-ir")
    assert code == 1 and "your pass break-ir broke the IR" in out and "none of the best candidates compiles" in err


# ----------------------------------------------------------------------------- seeing the pipeline


def test_print_ir_after_all_writes_one_file_per_pass_under_the_dump_dir(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--dump-dir", str(tmp_path),
                           "--print-ir-after-all")
    assert code == 0
    names = sorted(os.listdir(tmp_path / "passes"))
    assert names == ["01-stack-layers.mlir", "02-autodiff.mlir", "03-sgd.mlir", "04-apply-strategy.mlir",
                     "05-apply-annotations.mlir", "06-propagate-layouts.mlir", "07-insert-reshard.mlir",
                     "08-reuse-resharded-residuals.mlir", "09-specialize-groups.mlir", "10-lower-reshard.mlir",
                     "11-fuse-kernels.group0.mlir"]
    text = (tmp_path / "passes" / "10-lower-reshard.mlir").read_text()
    assert text.startswith("// -----// IR Dump After lower-reshard (physical) //----- //\n")
    assert text.split("\n", 1)[1] == run_cli(capsys, "compile", MLP, "--strategy", DP2)[1]
    kernel = (tmp_path / "passes" / "11-fuse-kernels.group0.mlir").read_text().split("\n", 1)[1]
    assert kernel == (tmp_path / "kernel_group0.mlir").read_text()


def test_print_ir_after_and_before_named_passes_to_files_or_stdout(capsys, tmp_path):
    code, _, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--dump-dir", str(tmp_path),
                         "--print-ir-after", "lower-reshard,autodiff", "--print-ir-before", "lower-reshard")
    assert code == 0
    assert sorted(os.listdir(tmp_path / "passes")) == ["01-autodiff.mlir", "02-before-lower-reshard.mlir",
                                                        "03-lower-reshard.mlir"]
    before = (tmp_path / "passes" / "02-before-lower-reshard.mlir").read_text()
    assert "dist.reshard" in before and "comm.all_reduce" not in before
    code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--level", "logical",
                           "--print-ir-before", "autodiff")
    head = "// -----// IR Dump Before autodiff (logical) //----- //\n"
    assert code == 0 and out.startswith(head) and out.count("builtin.module") == 2
    traced = out[len(head):out.index("builtin.module", len(head) + 1)]
    assert "graph.relu_grad" not in traced and "graph.relu " in traced
    code, _, err = run_cli(capsys, "compile", MLP, "--print-ir-after", "lower-reshard,nope")
    one_line_error(code, err, "--print-ir-after", "'nope'")


def test_pass_timing_prints_each_pass_with_its_share_and_op_counts(capsys):
    code, out, err = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--pass-timing")
    assert code == 0 and "builtin.module" in out
    lines = err.splitlines()
    assert lines[0].startswith("pass timing") and lines[1].split() == ["pass", "level", "wall", "ms", "share",
                                                                      "ops", "before", "ops", "after"]
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert list(rows) == ["stack-layers", "autodiff", "sgd", "apply-strategy", "apply-annotations",
                          "propagate-layouts", "insert-reshard", "reuse-resharded-residuals", "specialize-groups",
                          "lower-reshard", "total"]
    assert rows["autodiff"][1] == "logical" and int(rows["autodiff"][5]) > int(rows["autodiff"][4])
    assert rows["insert-reshard"][4:] == ["61", "68"]  # 7 reshards: the loss and six gradients
    shares = sum(float(r[3].rstrip("%")) for name, r in rows.items() if name != "total")
    assert abs(shares - 100) < 0.5


# ----------------------------------------------------------------------------- the same flags on hspmd-opt


def test_hspmd_opt_prints_times_and_checks_user_passes(capsys, tmp_path, passes_file):
    code, out, _ = run_cli(capsys, "compile", MLP, "--strategy", DP2, "--level", "annotated")
    annotated = tmp_path / "annotated.mlir"
    annotated.write_text(out)
    dump = tmp_path / "dump"
    assert opt_main([str(annotated), "-p", "specialize-groups,lower-reshard", "--print-ir-after-all",
                     "--dump-dir", str(dump), "--pass-timing"]) == 0
    out, err = capsys.readouterr()
    assert sorted(os.listdir(dump / "passes")) == ["01-specialize-groups.mlir", "02-lower-reshard.mlir"]
    assert (dump / "passes" / "02-lower-reshard.mlir").read_text().split("\n", 1)[1] == out
    assert "specialize-groups" in err and "lower-reshard" in err and "total" in err
    assert opt_main([str(annotated), "-p", "specialize-groups", "--print-ir-before", "specialize-groups"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("// -----// IR Dump Before specialize-groups //----- //\n") and out.count("builtin.module {") == 0
    assert opt_main([str(annotated), "--load-pass", passes_file, "-p", "specialize-groups,lower-reshard,break-ir"]) == 1
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "your pass break-ir broke the IR" in lines[0] and "Traceback" not in err
    assert opt_main([str(annotated), "-p", "specialize-groups", "--print-ir-after", "lower-reshard"]) == 1
    assert "no pass 'lower-reshard'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the pieces


def test_pipeline_text_parses_back_what_it_prints():
    from hspmd.transforms.pass_pipeline import Insertion, Pipeline, PipelineEdits, PipelineTextError, \
        parse_pipeline_text
    from hspmd.transforms.sgd import SGD

    text = "// a comment\nlogical: autodiff,sgd{lr=0.1 momentum=0.9}\nphysical: specialize-groups,lower-reshard\n"
    levels = parse_pipeline_text(text)
    assert list(levels) == ["logical", "physical"] and levels["logical"][1] == SGD(lr=0.1, momentum=0.9)
    assert Pipeline({k: tuple(v) for k, v in levels.items()}).text("logical") == "autodiff,sgd{lr=0.1 momentum=0.9}"
    with pytest.raises(PipelineTextError, match="needs a level"):
        parse_pipeline_text("autodiff")
    with pytest.raises(PipelineTextError, match="names no level"):
        parse_pipeline_text("logical: autodiff\nsgd")
    with pytest.raises(PipelineTextError, match="given twice"):
        parse_pipeline_text("logical: autodiff\nlogical: sgd")
    pipeline = Pipeline({"logical": tuple(levels["logical"])})
    edited = PipelineEdits(insertions=(Insertion.parse("sgd=autodiff", after=False),)).apply(pipeline)
    assert edited.text("logical") == "autodiff,autodiff,sgd{lr=0.1 momentum=0.9}"
