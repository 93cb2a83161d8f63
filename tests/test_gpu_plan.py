"""The GPU runtime without a GPU: device programs and the CUDA plan on the emulated device.

`device-kernels` gives every op of a program a GPU kernel (or a GEMM, or a view); the device
program runs first on the CPU plan (each new kernel's CPU build against the fused CPU level:
the same losses), then as a CUDA plan on `EmulatedDevice` (one arena, fixed pointers,
cuBLAS-convention GEMMs, the step replayed): the CPU backend's losses and parameters. The
GEMM mapping is checked against NumPy's products bit for bit, the row kernels with a block
of several emulated threads (the GPU's block reductions), the sources with NVRTC. `hspmd run
--device cuda` runs under the test switch `HSPMD_EMULATE_GPU=1`, and refuses cleanly without it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import EXAMPLES, run_cli, train_plan, train_step
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.compiler import compile_script, run_passes
from hspmd.dialects.graph.matmul import matmul_rhs_grad_values, matmul_values
from hspmd.dialects.graph.moe import expert_matmul_rhs_grad_values
from hspmd.frontend.script import load_script
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.cuda.device import DeviceArray
from hspmd.runtime.cuda.emulated import EmulatedDevice
from hspmd.runtime.cuda.gemm import gemm_for, numpy_gemm
from hspmd.runtime.cuda.plan import build_device_plan
from hspmd.runtime.plan import build_plan
from hspmd.transforms.util import PassError

SMALL_GPT = {"model.layers": 2, "model.d_model": 32, "model.seq_len": 16, "data.batch_size": 8}
CASES = {
    "mlp": ("mlp.py", {}),
    "gpt-dropout": ("gpt.py", {**SMALL_GPT, "model.dropout": 0.1}),
    "llama": ("llama.py", {"model.layers": 2, "model.d_model": 32, "model.seq_len": 16}),
    "moe": ("moe.py", {}),
}


@pytest.fixture(scope="module")
def programs():
    """Per case: (script, compiled, the CPU kernel level, the device program)."""
    out = {}
    for name, (script_name, overrides) in CASES.items():
        script = load_script(os.path.join(EXAMPLES, script_name), overrides)
        compiled = compile_script(script, "[0]: dp=1", 1)
        ((_, fused),) = compiled.kernel_groups()
        ((_, device),) = compiled.device_groups()
        out[name] = (script, compiled, fused, device)
    return out


def _cpu_losses(programs, name, steps=3):
    script, compiled, fused, _ = programs[name]
    (comm,) = InProcessCommunicator.create_world(1)
    return train_plan(build_plan(train_step(fused), 0, comm), script, compiled, steps)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_device_program_has_only_kernels_gemms_and_views(programs, name):
    *_, device = programs[name]
    ops = [op for op in device.walk() if op.parent_op() is not None and op.parent_op().name == "func.func"]
    left = {op.name for op in ops}
    assert left <= {"kernel.fused", "graph.matmul", "graph.matmul_rhs_grad", "graph.expert_matmul",
                    "graph.expert_matmul_rhs_grad", "graph.reshape", "graph.transpose", "graph.parameter", "graph.input",
                    "graph.constant", "graph.output", "graph.assign", "graph.scan", "func.return", "func.call"}, left
    for t in (op for op in ops if op.name == "graph.transpose"):  # a GEMM's transpose flag, never written out
        assert {u.operation.name for u in t.result.uses} <= {"graph.matmul", "graph.expert_matmul"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_device_programs_kernels_give_the_cpu_levels_losses(programs, name):
    """Every GPU kernel, built for the CPU, in the CPU plan: the fused CPU level's numbers."""
    script, compiled, _, device = programs[name]
    ref, ref_params = _cpu_losses(programs, name)
    (comm,) = InProcessCommunicator.create_world(1)
    got, params = train_plan(build_plan(train_step(device), 0, comm), script, compiled, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_cuda_plan_on_the_emulated_device_gives_the_cpu_backends_numbers(programs, name):
    script, compiled, _, device = programs[name]
    ref, ref_params = _cpu_losses(programs, name)
    plan = build_device_plan(train_step(device), 0, EmulatedDevice())
    got, params = train_plan(plan, script, compiled, 3)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert plan.peak_bytes >= sum(a.nbytes for a in plan.param_arrays.values())


def test_row_kernels_with_blocks_of_several_threads_give_the_same_losses(programs):
    """The GPU's algorithm (block reductions over 4 emulated threads, barriers, shuffles)."""
    script, compiled, _, device = programs["gpt-dropout"]
    ref, _ = _cpu_losses(programs, "gpt-dropout", 2)
    got, _ = train_plan(build_device_plan(train_step(device), 0, EmulatedDevice(team=4)), script, compiled, 2)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_a_replayed_step_equals_a_step_run_call_by_call(programs):
    script, compiled, _, device = programs["gpt-dropout"]
    graph = build_device_plan(train_step(device), 0, EmulatedDevice(), cuda_graph=True)
    calls = build_device_plan(train_step(device), 0, EmulatedDevice(), cuda_graph=False)
    assert train_plan(graph, script, compiled, 3)[0] == train_plan(calls, script, compiled, 3)[0]
    assert (graph.graphs_captured, graph.capture_failures, calls.graphs_captured) == (1, [], 0)
    assert graph.replay_text() == ", split into 1 CUDA graph to capture after step 1"


def _side_calls(device: EmulatedDevice, bucket: int, log: list):
    """A bucket's fork, side-stream work and join on `device`, as the plan marks them."""
    from hspmd.runtime.cuda.plan import _bucket_side

    return [_bucket_side(device.prepare_fork(), bucket),
            _bucket_side(device.prepare_on_side(lambda stream: log.append(f"sum{bucket}")), bucket),
            _bucket_side(device.prepare_join(), bucket)]


def _plan_of(device, calls):
    from hspmd.runtime.cuda.plan import DevicePlan

    plan = DevicePlan(0, device, [], [], [], [])
    plan.calls = list(calls)
    return plan


def test_the_emulated_device_refuses_the_captures_cuda_refuses():
    """What CUDA's stream capture checks of the side stream: a fork joined in its own capture."""
    from hspmd.runtime.cuda.device import CaptureError
    from hspmd.runtime.cuda.plan import _host_call

    device, log = EmulatedDevice(), []
    fork, work, join = _side_calls(device, 0, log)
    device.capture([fork, work, join])()
    assert log == ["sum0"]
    with pytest.raises(CaptureError, match="cudaErrorStreamCaptureUnjoined"):
        device.capture([fork, work])
    with pytest.raises(CaptureError, match="cudaErrorStreamCaptureIsolation"):
        device.capture([join])
    with pytest.raises(CaptureError, match="forked outside this capture"):
        device.capture([work, join])
    with pytest.raises(CaptureError, match="runs between graphs"):
        device.capture([_host_call(lambda: None)])


def test_a_host_call_between_a_fork_and_its_join_takes_them_out_of_the_graphs():
    """A bucket's fork, sum and join stay in one graph: where a host call falls between them
    (another bucket's MPI poll, a host-staged collective) they run between the graphs, and so does
    a bucket whose span then holds them; the rest is captured, nothing is refused."""
    from hspmd.runtime.cuda.plan import _host_call

    device, log = EmulatedDevice(), []
    k = [device.prepare_copy(device.alloc(4), device.alloc(4), 4) for _ in range(4)]
    a, b = _side_calls(device, 0, log), _side_calls(device, 1, log)
    host = _host_call(lambda: log.append("host"))
    # b forks inside a's span; a is split by the host call, then b's span holds a's join
    calls = [k[0], *a[:2], *b[:2], k[1], host, k[2], a[2], b[2], k[3], *_side_calls(device, 2, log)]
    plan = _plan_of(device, calls)
    parts = plan.graph_parts()
    assert [(captured, len(c)) for captured, c in parts] == [(True, 1), *[(False, 1)] * 4, (True, 1), (False, 1),
                                                              (True, 1), (False, 1), (False, 1), (True, 4)]
    plan._graph = plan._captured()
    assert (plan.graphs_captured, plan.capture_failures) == (4, [])
    assert plan.replay_text() == (", split into 4 CUDA graphs to capture after step 1 between 1 host-staged and 6 NCCL calls")
    for part in plan._graph:
        part()
    assert log == ["host", "sum0", "sum1", "sum2"]


def test_a_refused_capture_is_counted_said_and_run_call_by_call(capsys):
    device, log = EmulatedDevice(), []
    fork, work, _ = _side_calls(device, 0, log)
    plan = _plan_of(device, [fork, work])  # never joined: no graph can hold it
    parts = plan._captured()
    assert plan.graphs_captured == 0 and len(plan.capture_failures) == 1
    assert "1 of 1 parts of the step could not be captured" in capsys.readouterr().err
    for part in parts:
        part()
    device.synchronize()
    assert log == ["sum0"]


def test_every_gpu_kernel_compiles_with_nvrtc(programs):
    from hspmd.codegen.nvrtc_check import check_module, nvrtc_status

    ok, why = nvrtc_status()
    if not ok:
        pytest.skip(f"NVRTC is not available here: {why}")
    for name in ("gpt-dropout", "moe"):
        assert all(size > 0 for size in check_module(programs[name][3]).values())


# ----------------------------------------------------------------------------- GEMMs


def _flat(shape, rng, dtype):
    return rng.standard_normal(shape).astype(dtype)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), k=st.integers(1, 9), n=st.integers(1, 9),
       lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), weight=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_the_gemm_of_every_product_gives_numpys_bits(m, k, n, lead, weight, dtype, seed):
    """cuBLAS's column-major call of each product, run on flat memory as cuBLAS reads it."""
    from types import SimpleNamespace

    rng = np.random.default_rng(seed)
    lead = tuple(lead)
    cases = [
        ("graph.matmul", [(*lead, m, k), (k, n) if weight else (*lead, k, n)], (*lead, m, n), matmul_values),
        ("graph.matmul_rhs_grad", [(*lead, m, k), (*lead, m, n)], (k, n), matmul_rhs_grad_values),
        ("graph.expert_matmul_rhs_grad", [(3, m, k), (3, m, n)], (3, k, n), expert_matmul_rhs_grad_values),
    ]
    for name, shapes, out_shape, reference in cases:
        x, y = (_flat(s, rng, dtype) for s in shapes)
        g = gemm_for(SimpleNamespace(name=name), shapes, out_shape, np.dtype(dtype))
        ops = [x, y]
        c = np.full(int(np.prod(out_shape)), np.nan, dtype)
        numpy_gemm(g, ops[g.a].reshape(-1), ops[g.b].reshape(-1), c)
        np.testing.assert_array_equal(c.reshape(out_shape), reference(x, y), err_msg=name)
    # operands read through a transpose of their last two dims (the memory holds the untransposed)
    shapes = [(m, k), (k, n)] if weight else [(*lead, m, k), (*lead, k, n)]
    for ta, tb in ((False, True), (True, False), (True, True)):
        if ta and weight and len(shapes[0]) > 2:
            continue
        x, y = (_flat(s, rng, dtype) for s in shapes)
        stored = [np.ascontiguousarray(np.swapaxes(v, -1, -2)) if t else v for v, t in ((x, ta), (y, tb))]
        g = gemm_for(SimpleNamespace(name="graph.matmul"), shapes, (*shapes[0][:-1], n), np.dtype(dtype), (ta, tb))
        c = np.full(int(np.prod((*shapes[0][:-1], n))), np.nan, dtype)
        numpy_gemm(g, stored[g.a].reshape(-1), stored[g.b].reshape(-1), c)
        np.testing.assert_allclose(c.reshape(*shapes[0][:-1], n), np.matmul(x, y), rtol=1e-5, atol=1e-5,
                                   err_msg=f"transposed {ta, tb}")


def test_device_arrays_read_as_host_arrays():
    device = EmulatedDevice()
    ptr = device.alloc(4 * 6)
    device.upload(ptr, np.arange(6, dtype=np.float32).reshape(2, 3))
    a = DeviceArray(device, ptr, (2, 3), np.dtype(np.float32))
    np.testing.assert_array_equal(np.asarray(a), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(np.asarray(a[1]), [3, 4, 5])
    assert [list(np.asarray(r)) for r in a] == [[0, 1, 2], [3, 4, 5]]
    assert float(DeviceArray(device, ptr + 4, (), np.dtype(np.float32))) == 1.0
    full = np.zeros((2, 3), np.float32)
    full[:] = a
    assert full[1, 2] == 5


# ----------------------------------------------------------------------------- refusals


def test_an_op_without_a_gpu_kernel_is_a_compile_error_naming_it():
    """A layer norm's backward in bfloat16 (the frontend computes norms in float32, but IR may say
    otherwise): its row kernel keeps per-row moments in scratch of its compute type, which a
    16-bit row kernel does not take, so compiling it for a GPU fails naming the op and why,
    never falling back to the host."""
    from hspmd.dialects import graph
    from hspmd.frontend.tracing import Tracer

    t = Tracer()
    x, w, dy = t.input("x", (4, 8), "bfloat16"), t.input("w", (8,), "bfloat16"), t.input("dy", (4, 8), "bfloat16")
    for i, v in enumerate(t.emit_all(graph.LayerNormGradOp(x.value, w.value, dy.value, 1e-5))):
        t.output(f"g{i}", v)
    module = t.finish()
    with pytest.raises(PassError, match="no GPU kernel for 'graph.layer_norm_grad' in @.*no bf16 scratch"):
        run_passes(module, "device-kernels")


# ----------------------------------------------------------------------------- the command line


def _log(path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(path).read().splitlines()]


def test_hspmd_run_device_cuda_on_the_emulated_device_logs_the_cpu_losses(tmp_path):
    gpt = os.path.join(EXAMPLES, "gpt.py")
    sets = [a for kv in SMALL_GPT.items() for a in ("--set", f"{kv[0]}={kv[1]}")]
    run_cli("hspmd", "run", "-n", "1", gpt, "--device", "cpu", "--steps", "4", "--log", str(tmp_path / "cpu.jsonl"),
            *sets, check=True, timeout=600)
    env = {"HSPMD_EMULATE_GPU": "1"}
    out = run_cli("hspmd", "run", "-n", "1", gpt, "--device", "cuda", "--steps", "4", "--log",
                  str(tmp_path / "gpu.jsonl"), "--dump-dir", str(tmp_path / "bundle"), *sets, check=True, timeout=600,
                  env=env)
    assert "plan: on an emulated GPU" in out.stdout and "split into 1 CUDA graph to capture after step 1" in out.stdout
    assert "could not be captured" not in out.stderr
    assert os.path.isfile(tmp_path / "bundle" / "device_group0.mlir")
    np.testing.assert_allclose(_log(tmp_path / "gpu.jsonl"), _log(tmp_path / "cpu.jsonl"), rtol=1e-4)
    again = run_cli("hspmd", "run", "-n", "1", str(tmp_path / "bundle"), "--kernels", "cuda", "--steps", "2",
                    "--no-cuda-graph", check=True, timeout=600, env=env)  # --kernels cuda: the other spelling
    assert "calls a step" in again.stdout and "CUDA graph" not in again.stdout


def test_hspmd_run_device_cuda_without_a_gpu_refuses_in_one_line():
    env = {"HSPMD_EMULATE_GPU": "0"}
    out = run_cli("hspmd", "run", "-n", "1", os.path.join(EXAMPLES, "mlp.py"), "--device", "cuda", "--steps", "2",
                  timeout=120, env=env)
    from hspmd.codegen.cupy_backend import gpu_status

    if gpu_status()[0]:
        pytest.skip("a GPU is here: --device cuda runs")
    assert out.returncode == 2
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "--device cuda: no usable GPU" in lines[0] and "Traceback" not in out.stderr


def test_checkpoints_move_between_the_emulated_gpu_and_the_cpu(tmp_path):
    """Written from a GPU run's device arrays, resumed on the CPU; and the other way."""
    mlp = os.path.join(EXAMPLES, "mlp.py")
    run_cli("hspmd", "run", "-n", "1", mlp, "--device", "cpu", "--steps", "5", "--log", str(tmp_path / "ref.jsonl"),
            check=True, timeout=600)
    ref = _log(tmp_path / "ref.jsonl")
    emulate = {"HSPMD_EMULATE_GPU": "1"}
    for first, second in (("cuda", "cpu"), ("cpu", "cuda")):
        d, log = tmp_path / f"ck-{first}", tmp_path / f"{first}-{second}.jsonl"
        run_cli("hspmd", "run", "-n", "1", mlp, "--device", first, "--steps", "2", "--checkpoint-dir", str(d),
                check=True, timeout=600, env=emulate)
        run_cli("hspmd", "run", "-n", "1", mlp, "--device", second, "--steps", "5", "--resume", str(d), "--log",
                str(log), check=True, timeout=600, env=emulate)
        np.testing.assert_allclose(_log(log), ref[2:], rtol=1e-6)


# ----------------------------------------------------------------------------- finding libcublas


def _fake_pathfinder(monkeypatch, found: str | None):
    """Make `cuda.pathfinder.load_nvidia_dynamic_lib("cublas")` find `found` (None: raise as it
    does where it finds none)."""
    import sys
    import types

    module = types.ModuleType("cuda.pathfinder")
    asked: list[str] = []

    def load_nvidia_dynamic_lib(name):
        asked.append(name)
        if found is None:
            raise RuntimeError(f"{name} not found")  # its DynamicLibNotFoundError is a RuntimeError
        return types.SimpleNamespace(abs_path=found, found_via="site-packages")

    module.load_nvidia_dynamic_lib = load_nvidia_dynamic_lib
    monkeypatch.setitem(sys.modules, "cuda.pathfinder", module)
    return asked


def _fake_places(tmp_path, monkeypatch):
    """A toolkit with libcublas.so.13 and a site directory holding CUDA 13's and CUDA 12's wheels."""
    import sys

    toolkit = tmp_path / "cuda" / "lib64"
    cu13, cu12 = (tmp_path / "site" / "nvidia" / d / "lib" for d in ("cu13", "cublas"))
    for d, name in ((toolkit, "libcublas.so.13"), (cu13, "libcublas.so.13"), (cu12, "libcublas.so.12")):
        d.mkdir(parents=True)
        (d / name).write_bytes(b"")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    return str(toolkit / "libcublas.so.13"), str(cu13 / "libcublas.so.13"), str(cu12 / "libcublas.so.12")


def test_libcublas_is_looked_for_through_cuda_pathfinder_first(tmp_path, monkeypatch):
    from hspmd.runtime.cuda import cublas

    toolkit, cu13, cu12 = _fake_places(tmp_path, monkeypatch)
    asked = _fake_pathfinder(monkeypatch, "/wheels/nvidia/cu13/lib/libcublas.so.13")
    got = cublas.library_candidates()
    assert asked == ["cublas"] and got[0] == "/wheels/nvidia/cu13/lib/libcublas.so.13"
    assert got.index(toolkit) < got.index(cu13) < got.index(cu12) < got.index("libcublas.so.12")
    assert got[-4:] == ["libcublas.so", "libcublas.so.13", "libcublas.so.12", "libcublas.so.11"]
    tried: list[str] = []

    def load(name):  # only CUDA 12's wheel and the bare names would load: the first that loads wins
        tried.append(name)
        if name != cu12 and not name.startswith("libcublas"):
            raise OSError(name)

    monkeypatch.setattr(cublas.ctypes, "CDLL", load)
    assert cublas.find_library() == cu12 and tried == got[:got.index(cu12) + 1]


@pytest.mark.parametrize("pathfinder", ["finds none", "absent"])
def test_libcublas_without_cuda_pathfinder_comes_from_the_toolkit_then_the_wheels(tmp_path, monkeypatch, pathfinder):
    import sys

    from hspmd.runtime.cuda import cublas

    toolkit, cu13, cu12 = _fake_places(tmp_path, monkeypatch)
    if pathfinder == "absent":
        monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)  # import raises ImportError
    else:
        _fake_pathfinder(monkeypatch, None)
    assert cublas.library_candidates()[:3] == [toolkit, cu13, cu12]
    monkeypatch.setattr(cublas.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    with pytest.raises(OSError, match="libcublas not found"):
        cublas.find_library()


# ----------------------------------------------------------------------------- the GPU machine's script


def test_the_gpu_checks_stage_timeouts_fit_the_machines_minutes():
    """`benchmarks/gpu_check.sh budget`: each part's stage timeouts add up to under its bound, and
    the two parts' run timeouts with a start-up of 2 minutes fit the 15 minutes the machine is lent."""
    import re
    import subprocess

    out = subprocess.run(["bash", os.path.join(os.path.dirname(EXAMPLES), "benchmarks", "gpu_check.sh"), "budget"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    parts = {m[0]: (int(m[1]), int(m[2]), int(m[3])) for m in
             re.findall(r"^(\w[\w ]*): the stage timeouts add up to (\d+) s \(bound (\d+) s; run with timeout_s=(\d+)\)",
                        out.stdout, re.M)}
    assert set(parts) == {"part 1", "part 2", "flash"}, out.stdout
    for total, bound, run_timeout in parts.values():
        assert total <= bound < run_timeout
    assert 120 + parts["part 1"][2] + parts["part 2"][2] <= 15 * 60
    assert parts["part 1"][1] <= 6 * 60 and parts["part 2"][1] <= 4 * 60
