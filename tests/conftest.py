"""Shared fixtures: paths, running the hspmd command lines in a subprocess, and a one-device GPT
step on the fused CPU kernels (for tests comparing plan options bit for bit)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
#: this run's seed for the tests that sample a large sweep (`HSPMD_TEST_SEED` fixes it)
RUN_SEED = int(os.environ.get("HSPMD_TEST_SEED", int.from_bytes(os.urandom(4), "little") % 100_000))
# the same seed in the processes started after this one (pytest-xdist's workers collect the same
# sampled test ids; the ranks and command lines a test starts)
os.environ["HSPMD_TEST_SEED"] = str(RUN_SEED)


def sampled(items, k: int, salt: str) -> list:
    """Return `k` of `items` (sorted), chosen by this run's seed and `salt` (a test file's name), so that
    every run checks another part of a sweep too long to run whole; the test ids name them."""
    import random

    items = sorted(items)
    return sorted(random.Random(f"{RUN_SEED}:{salt}").sample(items, min(k, len(items))))


def sampled_kinds(items, kind, salt: str, extra: int = 0) -> list:
    """Return one of `items` of every kind (`kind(item)`: the cases that test the same path), chosen
    by this run's seed and `salt` (a test's name), and `extra` more of the others, in the order of
    `items`: every run tests every kind, and successive runs test every case; the test ids name them."""
    import random

    rng = random.Random(f"{RUN_SEED}:{salt}")
    groups: dict = {}
    for i, item in enumerate(items):
        groups.setdefault(kind(item), []).append(i)
    chosen = {rng.choice(group) for group in groups.values()}
    rest = [i for i in range(len(items)) if i not in chosen]
    chosen |= set(rng.sample(rest, min(extra, len(rest))))
    return [items[i] for i in sorted(chosen)]


def pytest_report_header(config):
    return f"HSPMD_TEST_SEED={RUN_SEED} (the sampled sweeps of this run)"


BIN = os.path.dirname(sys.executable)


def pytest_assertrepr_compare(op, left, right):
    """A failed `==` of two long byte strings (arrays' `tobytes()`) explained in three lines: pytest's
    own explanation diffs their reprs line by line, which takes minutes for a few megabytes."""
    if op != "==" or not (isinstance(left, bytes) and isinstance(right, bytes)) or max(len(left), len(right)) <= 256:
        return None
    import numpy as np

    n = min(len(left), len(right))
    a, b = np.frombuffer(left, np.uint8, n), np.frombuffer(right, np.uint8, n)
    differ = np.flatnonzero(a != b)
    first = int(differ[0]) if differ.size else n
    return [f"{len(left)} bytes == {len(right)} bytes",
            f"{differ.size} of the first {n} bytes differ; the first at byte {first}",
            f"left[{first}:{first + 8}] = {left[first:first + 8]!r}, right[{first}:{first + 8}] = {right[first:first + 8]!r}"]


def numpy_sums_in_one_chain() -> bool:
    """Whether `np.matmul` here (this CPU's BLAS on its current thread count) multiplies attention's
    float32 products as one chain of fused multiply-adds in the sum's order, as the runtime's C++
    small-products kernel does. OpenBLAS's kernels do on the CPUs the bit-for-bit tests of block
    products and C++ products were written on; on an AMD EPYC (OpenBLAS 0.3.31, Haswell kernels)
    they add in another order, and there those tests compare to rounding instead."""
    from hspmd.runtime.cpu.blas_threads import BlasCount

    return _sums_in_one_chain(BlasCount().get())


@functools.cache
def _sums_in_one_chain(threads: int) -> bool:
    import numpy as np

    from hspmd.runtime.cpu.blas_threads import same_bits
    from hspmd.runtime.cpu.native import load
    from hspmd.runtime.cpu.small_matmul import SmallMatmul

    lib, _ = load()
    if lib is None:
        return False
    kernel = SmallMatmul(lib.hs_small_matmul_f32, lambda: threads).kernel("", np.matmul)
    rng = np.random.default_rng(0)
    for m, k, n in ((128, 64, 128), (128, 128, 64), (40, 8, 40)):
        a = rng.standard_normal((4, m, k)).astype(np.float32)
        b = rng.standard_normal((4, k, n)).astype(np.float32)
        if not same_bits(kernel(a, b), np.matmul(a, b)):
            return False
    return True


def assert_bits_or_close(actual, desired, exact: bool, err_msg: str = "", rtol: float = 1e-4, atol: float = 1e-5):
    """Assert the same bits where `exact`, else equality to rounding (`rtol`, `atol`)."""
    import numpy as np

    if exact:
        np.testing.assert_array_equal(actual, desired, err_msg=err_msg)
    else:
        np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, err_msg=err_msg)

def run_cli(
    *args: str, timeout: float = 120, check: bool = False, cwd: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run an installed console script (`hspmd`, `hspmd-opt`) and return the finished process."""
    exe = os.path.join(BIN, args[0])
    # where the project is on the path but not installed (the GPU machine): the module itself
    command = [exe] if os.path.isfile(exe) else [sys.executable, "-m", {"hspmd": "hspmd.cli.main",
                                                                         "hspmd-opt": "hspmd.cli.opt"}[args[0]]]
    proc = subprocess.run(
        [*command, *args[1:]], capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli


def gpt_cpu_step(overrides: dict):
    """Return (script, compiled, train_step) of `examples/gpt.py` with `overrides` (no dropout)
    on one device, the kernel-level program on the fused CPU kernels, as `hspmd run` runs it."""
    from hspmd.compiler import compile_script
    from hspmd.dialects.levels import physical_groups
    from hspmd.frontend.script import load_script
    from hspmd.runtime.kernel_exec import select_program

    script = load_script(os.path.join(EXAMPLES, "gpt.py"), {"model.dropout": 0.0, **overrides})
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, physical),) = physical_groups(compiled.physical)
    ((_, fused),) = compiled.kernel_groups()
    module = select_program(physical, fused, "cpu")
    fn = next(op for op in module.body.block.ops if getattr(op, "sym_name", None) is not None
              and op.sym_name.data == "train_step")
    return script, compiled, fn


def train_plan(plan, script, compiled, steps: int = 3):
    """Run `steps` training steps of `plan` from its initial state; return (losses, parameters).
    A GPU plan's step must have been captured without a refusal (`DevicePlan.capture_failures`:
    the emulated device refuses what CUDA's stream capture refuses)."""
    import numpy as np

    from hspmd.runtime.worker import step_inputs

    config = {**script.config, "lr_schedule": compiled.lr_schedule}
    state, names, batches = plan.initial_state(0), {leaf.name for leaf in plan.inputs}, script.batches()
    losses = [float(plan.run(state, plan.local_batch({**next(batches), **step_inputs(n, config, names)}))["loss"])
              for n in range(1, steps + 1)]
    assert not getattr(plan, "capture_failures", None), plan.capture_failures
    return losses, {k: np.array(v) for k, v in state.items()}


@pytest.fixture(scope="module")
def gpu():
    """The CUDA GPU 0 through CuPy, as the GPU plan uses it (`CupyDevice`); the test skips, saying
    why, where CuPy or a GPU is missing (gpu-marked tests on machines without one)."""
    from hspmd.codegen.cupy_backend import gpu_status

    ok, why = gpu_status()
    if not ok:
        pytest.skip(f"needs CuPy and a CUDA GPU: {why}")
    from hspmd.runtime.cuda.cupy_device import CupyDevice

    return CupyDevice(0)


def train_step(module):
    """Return the `@train_step` function of a (group) module."""
    return next(op for op in module.walk() if getattr(op, "sym_name", None) is not None
                and op.sym_name.data == "train_step")


def run_imported(program, batch: dict, stack: bool = False) -> dict:
    """Return the outputs ("loss", "grad:<parameter>") of one step of an imported program
    (`hs.from_torch`) on one device, with its own weights, through the physical plan; with
    `stack`, its repeated layers stacked (`stack-layers`; the outputs still name each layer)."""
    import numpy as np

    from hspmd.compiler import annotate, run_passes, to_physical
    from hspmd.dialects import graph
    from hspmd.dialects.levels import physical_groups
    from hspmd.ir.stacked_names import is_stacked, layer_names
    from hspmd.runtime.comm import InProcessCommunicator
    from hspmd.runtime.plan import build_plan
    from hspmd.runtime.stacked import per_layer

    module = program.module
    run_passes(module, "stack-layers,autodiff" if stack else "autodiff")
    annotate(module, "[0]: dp=1")
    to_physical(module)
    ((_, group),) = physical_groups(module)
    (comm,) = InProcessCommunicator.create_world(1)
    plan = build_plan(train_step(group), 0, comm)
    state = {k: v.copy() for k, v in program.weights.items()}
    for name in [o.tensor_name.data for o in module.walk() if isinstance(o, graph.ParameterOp)]:
        if is_stacked(name):  # `stack` made it: the layers' weights as one array
            state[name] = np.stack([state.pop(n) for n in layer_names(name)])
    return per_layer(plan.run(state, plan.local_batch({k: np.asarray(v) for k, v in batch.items()})))
