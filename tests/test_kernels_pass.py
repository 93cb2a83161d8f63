"""The `fuse-kernels` pass and the `kernel` dialect on IR text; the kernel level of the CLI;
NVRTC checks of every kernel; the CPU build's cache; the fallbacks (no compiler, no NVRTC,
no CuPy/GPU); a whole GPT step fused vs per-op NumPy; the CuPy backend where a GPU is."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from hspmd.codegen import cpu_compile
from hspmd.dialects.kernel import FusedOp
from hspmd.dialects.context import IRTextError, module_text, parse_module
from hspmd.runtime import kernel_exec
from hspmd.transforms.fuse_kernels import fuse_module

from conftest import EXAMPLES



needs_cxx = pytest.mark.skipif(cpu_compile.find_compiler() is None, reason="needs a C++ compiler")
F = "tensor<4x8xf32>"


def fused(text: str):
    module = parse_module("builtin.module {\n" + text + "\n}")
    fuse_module(module)
    return module


def exp_module():
    """Return a module of one function computing exp(x): one op to fuse."""
    return parse_module(f"""builtin.module {{
func.func @f(%x: {F}) -> {F} {{
  %1 = graph.exp %x : ({F}) -> {F}
  func.return %1 : {F}
}}
}}""")


def fused_copy(module):
    """Return a fused copy of `module` (what the compiler writes as a bundle's kernel level)."""
    copy = module.clone()
    fuse_module(copy)
    return copy


def names(module) -> list[str]:
    fn = module.body.block.ops.first
    return [op.name for op in fn.body.block.ops]


# ----------------------------------------------------------------------------- the pass


def test_bias_gelu_becomes_one_kernel_and_the_ir_prints_and_parses_back():
    m = fused(f"""func.func @f(%x: {F}, %w: tensor<8x8xf32>, %b: tensor<8xf32>) -> ({F}, {F}) {{
  %h = graph.matmul %x, %w : ({F}, tensor<8x8xf32>) -> {F}
  %bb = graph.broadcast %b {{dims = array<i64: 1>}} : (tensor<8xf32>) -> {F}
  %s = graph.add %h, %bb : ({F}, {F}) -> {F}
  %g = graph.gelu %s {{approximate = "tanh"}} : ({F}) -> {F}
  func.return %s, %g : {F}, {F}
}}""")
    assert names(m) == ["graph.matmul", "kernel.fused", "func.return"]  # the matmul stays a BLAS call
    (op,) = [o for o in m.walk() if isinstance(o, FusedOp)]
    assert len(op.outputs) == 2 and op.launch_list[0][0] == "row" and op.dtype.data == "f32"
    assert "HS_KERNEL void k0_add_gelu(" in op.source.data
    text = module_text(m)
    assert module_text(parse_module(text)) == text


def test_no_group_spans_a_collective_or_a_call_and_unknown_ops_stay():
    m = fused(f"""func.func private @g(%a: {F}) -> {F} {{
  %b = graph.exp %a : ({F}) -> {F}
  %c = graph.exp %b : ({F}) -> {F}
  func.return %c : {F}
}}
func.func @f(%x: {F}) -> ({F}, {F}, tensor<8x4xf32>) {{
  %1 = graph.exp %x : ({F}) -> {F}
  %2 = comm.all_reduce %x {{groups = [array<i64: 0, 1>]}} : {F} -> {F}
  %3 = graph.exp %1 : ({F}) -> {F}
  %4 = func.call @g(%3) : ({F}) -> {F}
  %5 = graph.tanh %3 : ({F}) -> {F}
  %6 = graph.transpose %5 {{perm = array<i64: 1, 0>}} : ({F}) -> tensor<8x4xf32>
  func.return %2, %4, %6 : {F}, {F}, tensor<8x4xf32>
}}""")
    g, f = list(m.body.block.ops)
    assert [o.name for o in g.body.block.ops] == ["kernel.fused", "func.return"]  # callees are fused too
    # exp before the all-reduce, exp after it, tanh after the call: three kernels, order kept
    assert [o.name for o in f.body.block.ops] == [
        "kernel.fused", "comm.all_reduce", "kernel.fused", "func.call", "kernel.fused", "graph.transpose",
        "func.return"]


def test_a_value_used_between_members_keeps_the_group_valid():
    # %2 is used by reduce_sum before %3 would join: %3 starts a new kernel instead
    m = fused(f"""func.func @f(%x: {F}, %y: {F}) -> ({F}, tensor<8xf32>) {{
  %1 = graph.exp %x : ({F}) -> {F}
  %2 = graph.mul %1, %y : ({F}, {F}) -> {F}
  %r = graph.reduce_sum %2 {{dims = array<i64: 0>}} : ({F}) -> tensor<8xf32>
  %rb = graph.broadcast %r {{dims = array<i64: 1>}} : (tensor<8xf32>) -> {F}
  %3 = graph.add %2, %rb : ({F}, {F}) -> {F}
  func.return %3, %r : {F}, tensor<8xf32>
}}""")
    assert names(m) == ["kernel.fused", "graph.reduce_sum", "kernel.fused", "func.return"]
    m.verify()


def test_integer_and_half_precision_ops_are_left_alone():
    h = "tensor<4x8xf16>"
    m = fused(f"""func.func @f(%x: {h}, %i: tensor<4xi64>) -> ({h}, tensor<4xi64>) {{
  %1 = graph.exp %x : ({h}) -> {h}
  %2 = graph.add %i, %i : (tensor<4xi64>, tensor<4xi64>) -> tensor<4xi64>
  func.return %1, %2 : {h}, tensor<4xi64>
}}""")
    assert names(m) == ["graph.exp", "graph.add", "func.return"]


def test_identical_kernels_share_one_name():
    m = fused(f"""func.func @f(%x: {F}, %y: {F}) -> ({F}, {F}) {{
  %1 = graph.exp %x : ({F}) -> {F}
  %2 = graph.relu %1 : ({F}) -> {F}
  %3 = graph.exp %y : ({F}) -> {F}
  %4 = graph.relu %3 : ({F}) -> {F}
  func.return %2, %4 : {F}, {F}
}}""")
    ops = [o for o in m.walk() if isinstance(o, FusedOp)]
    assert len(ops) == 2 and ops[0].kernel.data == ops[1].kernel.data


def test_the_pass_runs_from_hspmd_opt_names():
    from hspmd.transforms import get_all_passes

    assert get_all_passes()["fuse-kernels"]().name == "fuse-kernels"


@pytest.mark.parametrize("edit,message", [
    ('dtype = "f32"', 'dtype = "i8"'),
    ('"elementwise k0_exp 32 0"', '"elementwise k0_exp x 0"'),
    ('"elementwise k0_exp 32 0"', '"elementwise nothere 32 0"'),
    ('"elementwise k0_exp 32 0"', '"sideways k0_exp 32 0"'),
])
def test_the_verifier_rejects_bad_kernels(edit, message):
    m = fused(f"""func.func @f(%x: {F}) -> {F} {{
  %1 = graph.exp %x : ({F}) -> {F}
  func.return %1 : {F}
}}""")
    text = module_text(m)
    assert edit in text
    with pytest.raises(IRTextError, match="kernel.fused"):
        parse_module(text.replace(edit, message))


# ----------------------------------------------------------------------------- NVRTC


def gpt_physical(tmp_path, *sets: str):
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script, parse_overrides
    from hspmd.dialects.levels import physical_groups

    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(list(sets)))
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, group),) = physical_groups(compiled.physical)
    return compiled, group


SMALL_GPT = ("model.d_model=32", "model.seq_len=16", "model.heads=2", "data.batch_size=4")


def test_every_kernel_of_gpt_compiles_with_nvrtc_for_sm80_and_sm90(tmp_path):
    from hspmd.codegen.nvrtc_check import check_module, nvrtc_status

    ok, why = nvrtc_status()
    assert ok, why  # the test extra installs NVRTC; no GPU is needed
    _, group = gpt_physical(tmp_path, *SMALL_GPT)
    fused_group = group.clone()
    fuse_module(fused_group)
    sizes = check_module(fused_group)
    assert set(sizes) == {"sm_80", "sm_90"} and all(s > 1000 for s in sizes.values())


def test_nvrtc_reports_a_bad_kernel_with_its_log():
    from hspmd.codegen.nvrtc_check import NvrtcError, check_source

    with pytest.raises(NvrtcError, match="undefined"):
        check_source("HS_KERNEL void bad(float* x, long n0, long n1) { HS_FOR(i, n0) x[i] = nope; }")


def test_nvrtc_missing_is_said_in_one_line(monkeypatch):
    from hspmd.codegen import nvrtc_check

    nvrtc_check.nvrtc.cache_clear()
    monkeypatch.setattr(nvrtc_check, "library_candidates", lambda major: [f"/nowhere/libnvrtc.so.{major}"])
    try:
        ok, why = nvrtc_check.nvrtc_status()
        assert not ok and "NVRTC is not available (no libnvrtc.so.12 or libnvrtc.so.13)" in why and "\n" not in why
        with pytest.raises(nvrtc_check.NvrtcError, match="NVRTC is not available"):
            nvrtc_check.check_source("HS_KERNEL void k(float* x, long n0, long n1) {}")
    finally:
        nvrtc_check.nvrtc.cache_clear()


def test_nvrtc_is_looked_for_where_cupys_loader_finds_it_first(tmp_path, monkeypatch):
    """cuda.pathfinder's libnvrtc (CuPy 14's: the check and CuPy then share one NVRTC and its
    builtins) comes first where it is of the major asked for, then the wheels' directories."""
    from hspmd.codegen import nvrtc_check

    found = tmp_path / "cuda" / "lib64" / "libnvrtc.so.13"
    wheel = tmp_path / "site" / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"
    for f in (found, wheel):
        f.parent.mkdir(parents=True)
        f.write_bytes(b"")
    monkeypatch.setattr(nvrtc_check, "_pathfinder_nvrtc", lambda: str(found))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert nvrtc_check.library_candidates(13)[0] == str(found)
    assert nvrtc_check.library_candidates(12)[:1] == [str(wheel)] and str(found) not in nvrtc_check.library_candidates(12)


def test_kernels_are_checked_with_nvrtc_12_for_sm80_and_nvrtc_13_for_sm90(monkeypatch):
    """The test extra installs CUDA 12's NVRTC and CUDA 13's (the GPU machine's) side by side,
    each loaded by its own path: a module's check compiles sm_80 with 12 and sm_90 with 13."""
    from hspmd.codegen import nvrtc_check

    ok, why = nvrtc_check.nvrtc_status()
    assert ok, why
    assert [n.version[0] for n in nvrtc_check.available()] == [12, 13], why
    assert nvrtc_check.nvrtc(12).path != nvrtc_check.nvrtc(13).path
    used = []
    real = nvrtc_check.Nvrtc.compile

    def compile(self, text, arch, name):
        used.append((self.version[0], arch))
        return real(self, text, arch, name)

    monkeypatch.setattr(nvrtc_check.Nvrtc, "compile", compile)
    source = "HS_KERNEL void k(float* x, long n0, long n1) { HS_FOR(i, n0) x[i] = hs_exp(x[i]); }"
    assert all(nvrtc_check.check_source(source, arch) > 0 for arch in nvrtc_check.ARCHS)
    assert used == [(12, "sm_80"), (13, "sm_90")]
    with pytest.raises(nvrtc_check.NvrtcError, match="(?s)sm_90, NVRTC 13.0.*undefined"):
        nvrtc_check.check_source(source.replace("hs_exp(x[i])", "nope"), "sm_90")


# ----------------------------------------------------------------------------- CPU build


@needs_cxx
def test_the_library_cache_is_keyed_by_content_and_survives_concurrent_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("HSPMD_CACHE_DIR", str(tmp_path))
    src = f"HS_KERNEL void twice_{os.getpid()}(const double* a, double* b, long n0, long n1) {{ HS_FOR(i, n0) b[i] = 2 * a[i]; }}"
    spec = [cpu_compile.LaunchSpec("elementwise", f"twice_{os.getpid()}", ("double", "double"))]
    paths, errors = [], []

    def build():
        try:
            paths.append(cpu_compile.build_library([src], spec))
        except Exception as err:  # noqa: BLE001 - collected for the assertion
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(paths)) == 1 and paths[0].parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temporary left behind
    lib = cpu_compile.load_library(paths[0])
    a = np.arange(5.0)
    b = np.empty(5)
    import ctypes

    ptrs = (ctypes.c_void_p * 2)(a.ctypes.data, b.ctypes.data)
    lib.function(f"twice_{os.getpid()}")(ptrs, 5, 0, 1)
    np.testing.assert_array_equal(b, 2 * a)
    other = cpu_compile.build_library([src.replace("2 *", "3 *")], spec)
    assert other != paths[0]


@needs_cxx
def test_a_compile_error_names_the_compiler_and_its_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HSPMD_CACHE_DIR", str(tmp_path))
    with pytest.raises(cpu_compile.CompileError, match="nope"):
        cpu_compile.build_library(["HS_KERNEL void bad(long n0, long n1) { nope; }"],
                                  [cpu_compile.LaunchSpec("elementwise", "bad", ())])


def test_without_a_compiler_the_run_falls_back_to_numpy_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(cpu_compile, "find_compiler", lambda: None)
    monkeypatch.setattr(kernel_exec, "_SAID", set())
    src = parse_module(f"""builtin.module {{
func.func @f(%x: {F}) -> {F} {{
  %1 = graph.exp %x : ({F}) -> {F}
  %2 = graph.tanh %1 : ({F}) -> {F}
  func.return %2 : {F}
}}
}}""")
    with pytest.warns(kernel_exec.KernelFallbackWarning, match="no C\\+\\+ compiler"):
        assert kernel_exec.select_program(src, fused_copy(src), "cpu") is src
    m = fused(module_text(src).split("{", 1)[1].rsplit("}", 1)[0])
    (op,) = [o for o in m.walk() if isinstance(o, FusedOp)]
    with pytest.warns(kernel_exec.KernelFallbackWarning):
        fn = kernel_exec.kernel_for(op)
        fn2 = kernel_exec.kernel_for(op)
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(fn(x), np.tanh(np.exp(x)))
    assert fn2(x).shape == (4, 8)
    err = capsys.readouterr().err
    assert err.count("no C++ compiler") == 2  # one line for select_program, one for the kernel: each once
    assert all(line.startswith("hspmd: ") for line in err.strip().splitlines())


@needs_cxx
def test_a_failing_compiler_falls_back_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HSPMD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_compile, "find_compiler", lambda: "/bin/false")
    monkeypatch.setattr(kernel_exec, "_SAID", set())
    src = exp_module()
    with pytest.warns(kernel_exec.KernelFallbackWarning, match="building the CPU kernels failed"):
        assert kernel_exec.select_program(src, fused_copy(src), "cpu") is src
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_cuda_backend_without_cupy_or_gpu_falls_back_to_the_cpu_with_one_line(monkeypatch, capsys):
    from hspmd.codegen import cupy_backend

    monkeypatch.setattr(cupy_backend, "gpu_status", lambda: (False, "CuPy is not installed"))
    monkeypatch.setattr(kernel_exec, "_SAID", set())
    src = exp_module()
    with pytest.warns(kernel_exec.KernelFallbackWarning, match="cuda backend is unavailable"):
        out = kernel_exec.select_program(src, fused_copy(src), "cuda")
    assert kernel_exec.select_program(src, fused_copy(src), "numpy") is src
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernel_exec.select_program(src, fused_copy(src), "tpu")
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("hspmd: the cuda backend is unavailable")
    if cpu_compile.find_compiler() is not None:
        assert any(isinstance(o, FusedOp) for o in out.walk())


def test_a_bundle_without_kernel_level_ir_runs_the_physical_program_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(kernel_exec, "_SAID", set())
    src = exp_module()
    with pytest.warns(kernel_exec.KernelFallbackWarning, match="no kernel-level IR"):
        assert kernel_exec.select_program(src, None, "cpu") is src
        assert kernel_exec.select_program(src, None, "cpu") is src
    assert kernel_exec.select_program(src, None, "numpy") is src
    assert capsys.readouterr().err.count("no kernel-level IR") == 1


def test_only_the_level_that_runs_is_loaded():
    """`hspmd run` hands loaders: parsing a large program's text is the slow part of a start."""
    src = exp_module()
    loaded: list[str] = []

    def loader(name, module):
        return lambda: loaded.append(name) or module

    assert kernel_exec.select_program(loader("physical", src), loader("kernels", fused_copy(src)), "numpy") is src
    assert loaded == ["physical"]
    if cpu_compile.find_compiler() is not None:
        loaded.clear()
        out = kernel_exec.select_program(loader("physical", src), loader("kernels", fused_copy(src)), "cpu")
        assert loaded == ["kernels"] and any(isinstance(o, FusedOp) for o in out.walk())


# ----------------------------------------------------------------------------- whole programs


@needs_cxx
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_gpt_training_step_fused_equals_numpy_per_op(tmp_path, precision):
    from hspmd.runtime.comm.inprocess import InProcessCommunicator
    from hspmd.runtime.plan import build_plan

    _, group = gpt_physical(tmp_path, *SMALL_GPT, f"precision={precision}")
    fused_group = kernel_exec.select_program(group, fused_copy(group), "cpu")
    assert fused_group is not group
    n_kernels = sum(isinstance(o, FusedOp) for o in fused_group.walk())
    assert n_kernels >= 10
    (comm,) = InProcessCommunicator.create_world(1)

    def step_of(mod):
        return next(o for o in mod.walk() if getattr(o, "sym_name", None) is not None
                    and o.sym_name.data == "train_step")

    results = []
    for mod in (group, fused_group):
        plan = build_plan(step_of(mod), 0, comm)
        state = plan.initial_state(0)
        losses = []
        for s in range(3):
            rng = np.random.default_rng(s)
            batch = {leaf.name: (np.array(3e-3) if leaf.name == "lr"
                                 else rng.integers(0, 256, leaf.global_shape)) for leaf in plan.inputs}
            losses.append(float(plan.run(state, plan.local_batch(batch))["loss"]))
        results.append((losses, state))
    (l0, s0), (l1, s1) = results
    tol = 1e-5  # bfloat16: its ops stay per-op NumPy, the float32 ones (norms, loss, Adam) fuse
    np.testing.assert_allclose(l1, l0, rtol=tol)
    for k in s0:
        np.testing.assert_allclose(s1[k], s0[k], rtol=100 * tol, atol=100 * tol)


@needs_cxx
def test_data_parallel_gpt_fused_on_two_ranks_equals_numpy(tmp_path):
    """dp=2: all-reduces of gradients between the fused kernels; fusion keeps their order."""
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script, parse_overrides
    from hspmd.dialects.levels import physical_groups
    from hspmd.runtime.comm import run_spmd
    from hspmd.runtime.plan import build_plan

    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(list(SMALL_GPT)))
    ((_, group),) = physical_groups(compile_script(script, "[0,1]: dp=2", 2).physical)
    fused_group = kernel_exec.select_program(group, fused_copy(group), "cpu")

    def comm_order(mod):
        return [o.name for o in mod.walk() if o.name.startswith("comm.")]

    assert comm_order(fused_group) == comm_order(group) and comm_order(group)
    rng = np.random.default_rng(0)
    batch = {"ids": rng.integers(0, 256, (4, 16)), "targets": rng.integers(0, 256, (4, 16)), "lr": np.array(1e-3)}

    def losses(mod):
        step = next(o for o in mod.walk() if getattr(o, "sym_name", None) is not None
                    and o.sym_name.data == "train_step")

        def body(comm):
            plan = build_plan(step, comm.rank, comm)
            state = plan.initial_state(0)
            return [float(plan.run(state, plan.local_batch(batch))["loss"]) for _ in range(2)]

        return run_spmd(2, body)

    np.testing.assert_allclose(losses(fused_group), losses(group), rtol=1e-5)


@needs_cxx
def test_heterogeneous_tensor_parallel_gpt_fused_equals_numpy():
    """Two groups with different programs (tp=2 on ranks 0,1; tp=1 on rank 2), each fused."""
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script, parse_overrides
    from hspmd.dialects.levels import physical_groups
    from hspmd.runtime.comm import run_spmd
    from hspmd.runtime.plan import build_plan

    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(list(SMALL_GPT)))
    groups = physical_groups(compile_script(script, "[0,1]: tp=2 share=2 | [2]: tp=1 share=1", 3).physical)
    fused_groups = {d: kernel_exec.select_program(m, fused_copy(m), "cpu") for d, m in groups}
    assert all(any(isinstance(o, FusedOp) for o in m.walk()) for m in fused_groups.values())
    rng = np.random.default_rng(0)
    batch = {"ids": rng.integers(0, 256, (4, 16)), "targets": rng.integers(0, 256, (4, 16)), "lr": np.array(1e-3)}

    def losses(mods):
        def body(comm):
            (mod,) = [m for d, m in mods.items() if comm.rank in d]
            step = next(o for o in mod.walk() if getattr(o, "sym_name", None) is not None
                        and o.sym_name.data == "train_step")
            plan = build_plan(step, comm.rank, comm)
            state = plan.initial_state(0)
            return [float(plan.run(state, plan.local_batch(batch))["loss"]) for _ in range(2)]

        return run_spmd(3, body)

    np.testing.assert_allclose(losses(fused_groups), losses(dict(groups)), rtol=1e-5)


def test_compile_emit_kernels_writes_cu_files_and_kernel_ir(tmp_path, cli):
    d = tmp_path / "out"
    proc = cli("hspmd", "compile", os.path.join(EXAMPLES, "gpt.py"), *[a for s in SMALL_GPT for a in ("--set", s)],
               "--emit", "kernels", "--dump-dir", str(d), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "kernel_group0.mlir" in proc.stdout
    cu = sorted(p.name for p in (d / "kernels").iterdir())
    assert len(cu) >= 10 and all(n.endswith(".cu") for n in cu)
    text = (d / "kernels" / cu[0]).read_text()
    assert "HS_KERNEL" in text and "hs_block_sum" in text  # complete: layer + source
    module = parse_module((d / "kernel_group0.mlir").read_text())
    kernels = {o.kernel.data for o in module.walk() if isinstance(o, FusedOp)}
    assert {n.removesuffix(".cu") for n in cu} == kernels


def test_emit_kernels_without_a_dump_dir_is_a_one_line_error(cli):
    proc = cli("hspmd", "compile", os.path.join(EXAMPLES, "gpt.py"), "--emit", "kernels")
    assert proc.returncode != 0 and "--emit kernels needs --dump-dir" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cupy_kernels_equal_numpy_on_a_gpu(tmp_path):
    from hspmd.codegen import cupy_backend

    ok, why = cupy_backend.gpu_status()
    if not ok:
        pytest.skip(why)
    import cupy

    _, group = gpt_physical(tmp_path, *SMALL_GPT)
    fused_group = group.clone()
    fuse_module(fused_group)
    rng = np.random.default_rng(0)
    for op in [o for o in fused_group.walk() if isinstance(o, FusedOp)]:
        args = kernel_exec.sample_operands(op, rng)
        ref = kernel_exec.numpy_call(op)(*args)
        got = cupy_backend.kernel_for(op)(*[cupy.asarray(a) for a in args])
        ref, got = (ref if isinstance(ref, tuple) else (ref,)), (got if isinstance(got, tuple) else (got,))
        for r, g in zip(ref, got):
            np.testing.assert_allclose(cupy.asnumpy(g), r, rtol=1e-4, atol=1e-5)
    a, b = rng.standard_normal((3, 5, 4)), rng.standard_normal((4, 6))
    np.testing.assert_allclose(cupy.asnumpy(cupy_backend.matmul(cupy.asarray(a), cupy.asarray(b))), a @ b)


def test_the_cuda_launch_configuration():
    from hspmd.codegen.cupy_backend import launch_config, row_block

    assert [row_block(c) for c in (1, 32, 128, 129, 256, 1024, 5000)] == [32, 32, 32, 64, 64, 256, 1024]
    assert launch_config("elementwise", 1000, 0) == (4, 256)
    assert launch_config("row", 10**6, 128) == (65535, 32)


def test_the_benchmark_prints_its_ratio_last(tmp_path):
    if cpu_compile.find_compiler() is None:
        pytest.skip("needs a C++ compiler")
    root = os.path.dirname(EXAMPLES)
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "kernels_vs_numpy.py"), "--repeat", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ratio ") and float(last.split()[1]) > 0


# ----------------------------------------------------------------------------- random programs


def _random_program(draw_ops: list[tuple[str, int, int]], outs: list[int]) -> str:
    """Return a function over [4, 6] f64 values built from (kind, a, b) steps: elementwise ops
    mixed with reduce_sum + broadcast round trips (unfusable ops between fusable ones)."""
    M, V = "tensor<4x6xf64>", "tensor<6xf64>"
    lines, names = [], ["%x", "%y"]
    for i, (kind, a, b) in enumerate(draw_ops):
        x, y = names[a % len(names)], names[b % len(names)]
        n = f"%v{i}"
        if kind in ("add", "mul", "sub"):
            lines.append(f"{n} = graph.{kind} {x}, {y} : ({M}, {M}) -> {M}")
        elif kind == "tanh":
            lines.append(f"{n} = graph.tanh {x} : ({M}) -> {M}")
        elif kind == "scale":
            lines.append(f"{n} = graph.scale {x} {{factor = 0.75 : f64}} : ({M}) -> {M}")
        else:  # a row-sum round trip: reduce, broadcast back
            lines.append(f"{n}r = graph.reduce_sum {x} {{dims = array<i64: 0>}} : ({M}) -> {V}")
            lines.append(f"{n} = graph.broadcast {n}r {{dims = array<i64: 1>}} : ({V}) -> {M}")
        names.append(n)
    rets = sorted({names[2 + o % (len(names) - 2)] for o in outs} | {names[-1]})
    return (f"func.func @f(%x: {M}, %y: {M}) -> ({', '.join([M] * len(rets))}) {{\n  " + "\n  ".join(lines)
            + f"\n  func.return {', '.join(rets)} : {', '.join([M] * len(rets))}\n}}")


def _evaluate(fn, args):
    from hspmd.runtime.numpy_ops import kernel_for as graph_kernel

    env = dict(zip(fn.body.block.args, args))
    for op in fn.body.block.ops:
        if op.name == "func.return":
            return [env[v] for v in op.operands]
        k = kernel_exec.kernel_for(op) if isinstance(op, FusedOp) else graph_kernel(op)
        res = k(*[env[v] for v in op.operands])
        for r, v in zip(op.results, res if isinstance(res, tuple) else (res,)):
            env[r] = v


@needs_cxx
@pytest.mark.parametrize("seed", range(12))
def test_random_programs_fuse_into_valid_ir_with_the_same_values(seed):
    rng = np.random.default_rng(seed)
    kinds = ["add", "mul", "sub", "tanh", "scale", "rowsum"]
    steps = [(kinds[rng.integers(len(kinds))], int(rng.integers(100)), int(rng.integers(100)))
             for _ in range(int(rng.integers(3, 14)))]
    text = _random_program(steps, [int(o) for o in rng.integers(0, 100, 3)])
    before = parse_module("builtin.module {\n" + text + "\n}")
    after = fused(text)
    after.verify()  # every use still follows its definition
    assert module_text(parse_module(module_text(after))) == module_text(after)
    x, y = rng.standard_normal((4, 6)), rng.standard_normal((4, 6))
    want = _evaluate(before.body.block.ops.first, [x, y])
    got = _evaluate(after.body.block.ops.first, [x, y])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)


def test_sigmoid_and_its_gradient_fuse_into_one_kernel_that_matches_numpy():
    """graph.sigmoid and graph.sigmoid_grad are elementwise: one fused kernel, built for the CPU."""
    if cpu_compile.find_compiler() is None:
        pytest.skip("no C++ compiler: the fused kernel cannot be built here")
    m = fused(f"""func.func @f(%x: {F}, %dy: {F}) -> {F} {{
  %1 = graph.sigmoid %x : ({F}) -> {F}
  %2 = graph.sigmoid_grad %1, %dy : ({F}, {F}) -> {F}
  func.return %2 : {F}
}}""")
    (op,) = [o for o in m.walk() if isinstance(o, FusedOp)]
    x = np.linspace(-6, 6, 32, dtype=np.float32).reshape(4, 8)
    dy = np.linspace(1, 2, 32, dtype=np.float32).reshape(4, 8)
    s = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(kernel_exec.kernel_for(op)(x, dy), dy * s * (1 - s), rtol=1e-5, atol=1e-7)


def test_binary_cross_entropy_and_its_gradient_fuse_and_match_numpy():
    """Confident logits (|z| = 30) neither overflow nor lose their small losses in the fused kernels."""
    if cpu_compile.find_compiler() is None:
        pytest.skip("no C++ compiler: the fused kernel cannot be built here")
    z = np.linspace(-30, 30, 32, dtype=np.float32).reshape(4, 8)
    y = (np.arange(32) % 2).astype(np.float32).reshape(4, 8)
    dy = np.full((4, 8), 0.5, np.float32)
    z64 = z.astype(np.float64)
    for body, args, expect in (
        (f"%1 = graph.binary_cross_entropy %z, %y : ({F}, {F}) -> {F}", (z, y), np.logaddexp(0, z64) - z64 * y),
        (f"%1 = graph.binary_cross_entropy_grad %z, %y, %dy : ({F}, {F}, {F}) -> {F}", (z, y, dy),
         (1 / (1 + np.exp(-z64)) - y) * dy),
    ):
        params = ", ".join(f"%{n}: {F}" for n in ("z", "y", "dy")[:len(args)])
        m = fused(f"func.func @f({params}) -> {F} {{\n  {body}\n  func.return %1 : {F}\n}}")
        (op,) = [o for o in m.walk() if isinstance(o, FusedOp)]
        np.testing.assert_allclose(kernel_exec.kernel_for(op)(*args), expect, rtol=1e-5, atol=1e-7)
