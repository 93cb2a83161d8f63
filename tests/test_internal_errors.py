"""Internal errors told apart from user errors (issue 31): a pass failing after the strategy checks is
the compiler's bug (`hspmd: internal error in <pass>: ...`, the IR it was given in a file, a request
to report it, exit code 3), a user's error stays one message and exit code 1."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from dataclasses import dataclass

import pytest
from xdsl.passes import ModulePass

from conftest import EXAMPLES, run_cli
from hspmd.compiler import InternalError, annotate_passes, physical_passes, run_passes, training_passes
from hspmd.dialects.context import module_text, parse_module
from hspmd.frontend.script import load_script, script_optimizer, trace_script
from hspmd.ir.strategy import StrategyRecord, parse_strategy
from hspmd.transforms.util import PassError

MLP = os.path.join(EXAMPLES, "mlp.py")


@dataclass(frozen=True)
class Boom(ModulePass):
    """A pass that fails as a buggy pass does: with an exception nobody meant to raise."""

    name = "boom"

    def apply(self, ctx, op) -> None:
        raise KeyError("a key the pass expected")


def _logical():
    script = load_script(MLP, {"batch_size": 8, "hidden": 16})
    logical = trace_script(script)
    run_passes(logical, training_passes(script_optimizer(script)))
    return logical


def test_a_pass_failing_after_the_strategy_checks_is_an_internal_error_with_its_input_written():
    record = StrategyRecord(0, parse_strategy("[0,1]: dp=2"))
    module = _logical()
    annotate, physical = annotate_passes(record), physical_passes(record)
    expected = _logical()  # what boom is given: the annotate passes and the first physical pass
    run_passes(expected, annotate)
    run_passes(expected, physical[:1], checked=True)
    with pytest.raises(InternalError) as info:
        run_passes(module, [*annotate, *physical[:1], Boom(), *physical[1:]])
    err = info.value
    assert err.pass_name == "boom" and str(err) == "internal error in boom: KeyError: 'a key the pass expected'"
    text = open(err.ir_path).read()
    assert text.startswith("// the input of boom, which failed")
    assert module_text(parse_module(text)) == module_text(expected)  # the IR before boom, made again


def test_a_pass_error_after_the_checks_is_internal_too_and_one_before_them_is_the_users():
    """lower-reshard's own PassError (the issue's `cannot tell the global shape`) is a compiler bug
    when the strategy checks passed; apply-strategy's refusal stays the user's error."""

    @dataclass(frozen=True)
    class Refuses(ModulePass):
        name = "refuses"

        def apply(self, ctx, op) -> None:
            raise PassError("lower-reshard: cannot tell the global shape from local types [192, 96]")

    record = StrategyRecord(0, parse_strategy("[0,1]: dp=2"))
    with pytest.raises(InternalError, match=r"^internal error in refuses: lower-reshard: cannot tell"):
        run_passes(_logical(), [*annotate_passes(record), Refuses()])
    with pytest.raises(PassError, match="batch rows") as info:  # 8 rows by shares 1:7: 1 row for dp=2
        run_passes(_logical(), annotate_passes(StrategyRecord(0, parse_strategy("[0,1]: dp=2 share=1 | [2]: dp=1 share=7"))))
    assert not isinstance(info.value, InternalError)
    with pytest.raises(PassError):  # before the checks (no checking pass, not `checked`): the user's
        run_passes(_logical(), [Refuses()])


_INJECT = textwrap.dedent("""
    import sys
    from dataclasses import dataclass
    from xdsl.passes import ModulePass
    import hspmd.compiler as compiler

    @dataclass(frozen=True)
    class Boom(ModulePass):
        name = "boom"
        def apply(self, ctx, op):
            raise KeyError("a key the pass expected")

    physical = compiler.physical_passes
    compiler.physical_passes = lambda record: [*physical(record)[:1], Boom(), *physical(record)[1:]]
    from hspmd.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("command", [["compile", MLP, "--strategy", "[0,1]: dp=2"],
                                     ["run", "-n", "1", MLP, "--steps", "1"]])
def test_hspmd_reports_an_injected_failing_pass_as_an_internal_error(command):
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _INJECT, *command], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "hspmd: internal error in boom: KeyError: 'a key the pass expected'", lines
    (path,) = re.findall(r"the IR given to boom is in (\S+)", proc.stderr)
    assert "graph.parameter" in open(path).read() and "please report it" in lines[-1]


def test_a_user_error_stays_exit_1_and_one_line():
    proc = run_cli("hspmd", "compile", MLP, "--strategy", "[0-3]: pp=4")  # 3 layers
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("hspmd: error: apply-strategy:") and "use pp <= 3" in line


def test_hspmd_opt_reports_a_crashing_pass_as_an_internal_error(tmp_path):
    (tmp_path / "boom.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from xdsl.passes import ModulePass

        @dataclass(frozen=True)
        class Boom(ModulePass):
            name = "boom"
            def apply(self, ctx, op):
                raise KeyError("a key the pass expected")
    '''))
    run_cli("hspmd", "compile", MLP, "--strategy", "[0,1]: dp=2", "--dump-dir", str(tmp_path / "b"), check=True)
    annotated = str(tmp_path / "b" / "annotated.mlir")
    proc = run_cli("hspmd-opt", annotated, "--load-pass", str(tmp_path / "boom.py"), "-p", "specialize-groups,boom")
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hspmd-opt: internal error in boom: KeyError")
    (path,) = re.findall(r"the IR given to boom is in (\S+)", proc.stderr)
    assert "builtin.module @group0" in open(path).read()  # after specialize-groups
    bad = run_cli("hspmd-opt", annotated, "-p", "lower-reshard")  # the input's fault: a user error
    assert bad.returncode == 1 and "run specialize-groups first" in bad.stderr


@pytest.mark.parametrize("steps", ["0", "-2"])
def test_run_refuses_steps_below_one(steps):
    proc = run_cli("hspmd", "run", "-n", "1", MLP, "--steps", steps)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"hspmd: error: --steps {steps}: a run trains at least 1 step"


def test_run_refuses_a_config_of_zero_steps():
    proc = run_cli("hspmd", "run", "-n", "1", MLP, "--set", "steps=0")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "steps=0: a run trains at least 1 step" in proc.stderr
