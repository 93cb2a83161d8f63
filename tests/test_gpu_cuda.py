"""The GPU runtime on a real GPU (marked `gpu`: they run wherever CuPy finds a GPU, and skip here
with the reason). `benchmarks/gpu_check.sh` runs them first on the GPU machine.

They check, on the device, what tests/test_gpu_plan.py checks on the emulated one: memory
round trips, cuBLAS's products against NumPy's, every kernel of the device programs against
its ops' NumPy kernels, whole training steps against the CPU backend (GPT, LLaMA, MoE, MLP),
a CUDA graph's replay against the calls, and the command line (`--device cuda`, `auto`,
checkpoints across devices, traces).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import EXAMPLES, run_cli, train_plan, train_step

from hspmd.compiler import compile_script
from hspmd.dialects.graph.matmul import matmul_rhs_grad_values, matmul_values
from hspmd.dialects.kernel import FusedOp
from hspmd.frontend.script import load_script
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.cuda.gemm import gemm_for
from hspmd.runtime.cuda.plan import build_device_plan
from hspmd.runtime.kernel_exec import numpy_call, sample_operands
from hspmd.runtime.plan import build_plan

pytestmark = pytest.mark.gpu
SMALL_GPT = {"model.layers": 2, "model.d_model": 64, "model.seq_len": 32, "data.batch_size": 8}
CASES = {
    "mlp": ("mlp.py", {}),
    "gpt": ("gpt.py", SMALL_GPT),
    "gpt-dropout": ("gpt.py", {**SMALL_GPT, "model.dropout": 0.1}),
    "llama": ("llama.py", {"model.layers": 2, "model.d_model": 64, "model.seq_len": 32}),
    "moe": ("moe.py", {}),
}


def _compiled(name):
    script_name, overrides = CASES[name]
    script = load_script(os.path.join(EXAMPLES, script_name), overrides)
    return script, compile_script(script, "[0]: dp=1", 1)


def test_memory_round_trips(gpu):
    x = np.random.default_rng(0).standard_normal((37, 5)).astype(np.float32)
    ptr = gpu.alloc(x.nbytes)
    gpu.upload(ptr, x)
    np.testing.assert_array_equal(gpu.download(ptr, x.shape, x.dtype), x)
    other = gpu.alloc(x.nbytes)
    gpu.prepare_copy(other, ptr, x.nbytes)()
    np.testing.assert_array_equal(gpu.download(other, x.shape, x.dtype), x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["rows-by-weight", "batched", "rhs-grad"])
def test_cublas_products_equal_numpys(gpu, case, dtype):
    rng = np.random.default_rng(1)
    if case == "rows-by-weight":
        shapes, out, name, ref = [(4, 33, 65), (65, 17)], (4, 33, 17), "graph.matmul", matmul_values
    elif case == "batched":
        shapes, out, name, ref = [(3, 4, 33, 65), (3, 4, 65, 17)], (3, 4, 33, 17), "graph.matmul", matmul_values
    else:
        shapes, out, name, ref = [(4, 33, 65), (4, 33, 17)], (65, 17), "graph.matmul_rhs_grad", matmul_rhs_grad_values
    x, y = (rng.standard_normal(s).astype(dtype) for s in shapes)
    g = gemm_for(SimpleNamespace(name=name), shapes, out, np.dtype(dtype))
    ptrs = []
    for arr in (x, y):
        ptrs.append(gpu.alloc(arr.nbytes))
        gpu.upload(ptrs[-1], arr)
    c = gpu.alloc(int(np.prod(out)) * np.dtype(dtype).itemsize)
    ops = [ptrs[0], ptrs[1]]
    gpu.prepare_gemm(g, ops[g.a], ops[g.b], c)()
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(gpu.download(c, out, dtype), ref(x, y), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["gpt-dropout", "llama", "moe"])
def test_every_kernel_of_a_device_program_equals_numpy(gpu, name):
    _, compiled = _compiled(name)
    ((_, device),) = compiled.device_groups()
    kernels = gpu.kernels(device)
    rng = np.random.default_rng(2)
    seen = set()
    for op in device.walk():
        if not isinstance(op, FusedOp) or op.kernel.data in seen:
            continue
        seen.add(op.kernel.data)
        args = sample_operands(op, rng)
        want = numpy_call(op)(*args)
        want = want if isinstance(want, tuple) else (want,)
        ptrs = []
        for a in args:
            ptrs.append(gpu.alloc(max(a.nbytes, 1)))
            gpu.upload(ptrs[-1], np.ascontiguousarray(a))
        outs = [gpu.alloc(max(w.nbytes, 1)) for w in want]
        item = 8 if op.dtype.data == "f64" else 4
        scratch = [gpu.alloc(n * item) for n in op.scratch_sizes]
        for kind, fname, n0, n1 in op.launch_list:
            gpu.prepare_launch(kernels, fname, kind, n0, n1, [*ptrs, *outs, *scratch])()
        for w, o in zip(want, outs):
            np.testing.assert_allclose(gpu.download(o, w.shape, w.dtype), w, rtol=2e-5, atol=1e-6, err_msg=op.kernel.data)


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_steps_on_the_gpu_equal_the_cpu_backend(gpu, name):
    script, compiled = _compiled(name)
    ((_, fused),) = compiled.kernel_groups()
    ((_, device),) = compiled.device_groups()
    (comm,) = InProcessCommunicator.create_world(1)
    ref, ref_params = train_plan(build_plan(train_step(fused), 0, comm), script, compiled, 5)
    got, params = train_plan(build_device_plan(train_step(device), 0, gpu), script, compiled, 5)
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    for k in ref_params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-3, atol=1e-5, err_msg=k)


def test_a_cuda_graph_replays_the_calls(gpu):
    """The step captured as one CUDA graph after step 1 (counted: a refused capture would run
    the calls one by one and still give their numbers) and replayed: the calls' numbers."""
    script, compiled = _compiled("gpt-dropout")
    ((_, device),) = compiled.device_groups()
    graph_plan = build_device_plan(train_step(device), 0, gpu, cuda_graph=True)
    graph = train_plan(graph_plan, script, compiled, 4)[0]
    assert graph_plan.capture_failures == [] and graph_plan.graphs_captured == 1
    calls_plan = build_device_plan(train_step(device), 0, gpu, cuda_graph=False)
    calls = train_plan(calls_plan, script, compiled, 4)[0]
    assert calls_plan.graphs_captured == 0
    np.testing.assert_array_equal(graph, calls)


def test_a_bucket_on_the_side_stream_is_captured_with_its_fork_and_join(gpu):
    """The side stream's fork, a sum queued there and its join, captured in one graph with a
    kernel-free copy before and after (what a bucket summed through NCCL makes): CUDA accepts the
    capture (no cudaErrorStreamCaptureUnjoined) and a replay gives the calls' result."""
    from hspmd.runtime.cuda.plan import DevicePlan, _bucket_side

    x = np.arange(64, dtype=np.float32)
    src, mid, dst = (gpu.alloc(x.nbytes) for _ in range(3))
    gpu.upload(src, x)
    rt = gpu.cupy.cuda.runtime

    def on_side(stream):  # the bucket's "sum": a copy queued on the side stream
        rt.memcpyAsync(dst, mid, x.nbytes, rt.memcpyDeviceToDevice, stream)

    plan = DevicePlan(0, gpu, [], [], [], [])
    plan.calls = [gpu.prepare_copy(mid, src, x.nbytes), _bucket_side(gpu.prepare_fork(), 0),
                  _bucket_side(gpu.prepare_on_side(on_side), 0), _bucket_side(gpu.prepare_join(), 0)]
    parts = plan._captured()
    assert (plan.graphs_captured, plan.capture_failures) == (1, [])
    for part in parts:
        part()
    np.testing.assert_array_equal(gpu.download(dst, x.shape, x.dtype), x)


def _log(path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(path).read().splitlines()]


def test_hspmd_run_device_cuda_logs_the_cpu_losses(gpu, tmp_path):
    gpt = os.path.join(EXAMPLES, "gpt.py")
    run_cli("hspmd", "run", "-n", "1", gpt, "--device", "cpu", "--steps", "20", "--log", str(tmp_path / "cpu.jsonl"),
            check=True, timeout=600)
    out = run_cli("hspmd", "run", "-n", "1", gpt, "--device", "cuda", "--steps", "20", "--log",
                  str(tmp_path / "gpu.jsonl"), check=True, timeout=600)
    assert "plan: on " in out.stdout and "emulated" not in out.stdout
    np.testing.assert_allclose(_log(tmp_path / "gpu.jsonl"), _log(tmp_path / "cpu.jsonl"), rtol=1e-4)


def test_device_auto_runs_on_the_gpu(gpu):
    out = run_cli("hspmd", "run", "-n", "1", os.path.join(EXAMPLES, "mlp.py"), "--steps", "3", check=True, timeout=600)
    assert "plan: on " in out.stdout and "MiB of device memory" in out.stdout


def test_checkpoints_move_between_the_gpu_and_the_cpu(gpu, tmp_path):
    mlp = os.path.join(EXAMPLES, "mlp.py")
    ref = tmp_path / "ref.jsonl"
    run_cli("hspmd", "run", "-n", "1", mlp, "--device", "cpu", "--steps", "6", "--log", str(ref), check=True, timeout=600)
    for first, second in (("cuda", "cpu"), ("cpu", "cuda")):
        d = tmp_path / f"ck-{first}"
        run_cli("hspmd", "run", "-n", "1", mlp, "--device", first, "--steps", "3", "--checkpoint-dir", str(d),
                check=True, timeout=600)
        log = tmp_path / f"{first}-{second}.jsonl"
        run_cli("hspmd", "run", "-n", "1", mlp, "--device", second, "--steps", "6", "--resume", str(d), "--log", str(log),
                check=True, timeout=600)
        np.testing.assert_allclose(_log(log), _log(ref)[3:], rtol=1e-6)


def test_a_trace_shows_the_kernels_run_on_the_gpu(gpu, tmp_path):
    trace = tmp_path / "trace.json"
    run_cli("hspmd", "run", "-n", "1", os.path.join(EXAMPLES, "gpt.py"), "--device", "cuda", "--steps", "2",
            "--trace", str(trace), check=True, timeout=600)
    events = json.loads(trace.read_text())
    names = {e.get("name", "") for e in (events["traceEvents"] if isinstance(events, dict) else events)}
    assert any(n.startswith("kernel.fused") for n in names) and "graph.matmul" in names
