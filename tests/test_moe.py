"""Mixture of experts: routing with capacity, the MoE layer against PyTorch, and expert
parallelism (`ep=`) equal to one device, dropped tokens included.

Sampled per run (`HSPMD_TEST_SEED`, printed in pytest's header; the test ids name the cases): the
in-process strategy sweeps run one strategy of each kind (ep alone, with dp, with tp, with a
pipeline, with ZeRO 1/2, with ZeRO 3; uneven placements plain, with shares, with ZeRO), and the
`hspmd run` sweep over mpiexec runs the uneven placement and one of the other strategies.

The routing is defined per sequence (one routing group), so the tokens dropped at an
expert's capacity do not depend on how the batch is split: `[0,1]: ep=2` and
`[0-3]: dp=2 ep=2` train the numbers of one device.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hspmd as hs
from conftest import EXAMPLES, run_cli, sampled_kinds
from test_ops_grad import compile_plan
from test_spmd_property import check_outputs, compile_step, run_step
from hspmd.compiler import compile_script, run_passes, write_bundle
from hspmd.dialects import graph
from hspmd.dialects.dist import layout_of
from hspmd.dialects.levels import physical_groups
from hspmd.frontend.nn import bind_parameters
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.frontend.tracing import Tracer
from hspmd.ir.layout import DUP, DistributedStates, Layout, split
from hspmd.runtime.comm import run_spmd
from hspmd.dialects.graph.moe import moe_route_values as moe_route
from hspmd.runtime.worker import train
from hspmd.transforms.util import PassError

MOE = os.path.join(EXAMPLES, "moe.py")
STEPS = 3
# capacity_factor 0.5 with top-2: an expert has T/E slots per sequence for 2T/E choices on
# average, so at least half of the choices are dropped, on every strategy alike
SMALL = ["model.d_model=32", "model.d_ff=32", "model.seq_len=8", "model.heads=2", "model.layers=2",
         "model.experts=4", "model.top_k=2", "model.capacity_factor=0.5", "data.batch_size=8", "optim.warmup=1"]


def route_by_loop(probs: np.ndarray, top_k: int, capacity: int) -> np.ndarray:
    """GShard's routing written plainly: choices rank by rank, tokens in order, slots first come."""
    g, s, e = probs.shape
    mask = np.zeros((g, s, e, capacity))
    for gi in range(g):
        order = [sorted(range(e), key=lambda x: (-probs[gi, si, x], x))[:top_k] for si in range(s)]
        used = [0] * e
        for rank in range(top_k):
            for si in range(s):
                x = order[si][rank]
                if used[x] < capacity:
                    mask[gi, si, x, used[x]] = 1
                used[x] += 1
    return mask


@settings(max_examples=60, deadline=None)
@given(g=st.integers(1, 3), s=st.integers(1, 9), e=st.integers(1, 5), data=st.data(), seed=st.integers(0, 2**16))
def test_route_matches_a_plain_loop(g, s, e, data, seed):
    top_k = data.draw(st.integers(1, e))
    capacity = data.draw(st.integers(1, 4))
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(e), size=(g, s))
    if data.draw(st.booleans()):  # ties: the lower expert index wins
        probs = np.round(probs, 1)
    got = moe_route(probs, top_k, capacity)
    np.testing.assert_array_equal(got, route_by_loop(probs, top_k, capacity))
    kept = got.sum(axis=(1, 3))
    assert (kept <= capacity).all()  # no expert holds more than its slots per group
    assert (got.sum(axis=(2, 3)) <= top_k).all()


def _route_kernel(g: int, s: int, e: int, top_k: int, capacity: int, dt: str):
    """Return (module, its one kernel.fused op) of a function that routes probabilities [g, s, e]."""
    from hspmd.dialects.context import parse_module
    from hspmd.runtime.kernel_exec import fused_ops
    from hspmd.transforms.fuse_kernels import fuse_module

    p, m = f"tensor<{g}x{s}x{e}x{dt}>", f"tensor<{g}x{s}x{e}x{capacity}x{dt}>"
    module = parse_module(f"builtin.module {{\nfunc.func @f(%p: {p}) -> {m} {{\n"
                          f"  %r = graph.moe_route %p {{top_k = {top_k} : i64}} : ({p}) -> {m}\n"
                          f"  func.return %r : {m}\n}}\n}}")
    fuse_module(module)
    (op,) = fused_ops(module)
    return module, op


@pytest.mark.skipif(__import__("hspmd.codegen.cpu_compile", fromlist=["x"]).find_compiler() is None,
                    reason="needs a C++ compiler")
@settings(max_examples=8, deadline=None)
@given(g=st.integers(1, 3), s=st.integers(1, 9), e=st.integers(1, 6), data=st.data(), seed=st.integers(0, 2**16))
def test_route_kernel_from_its_cuda_source_matches_numpy(g, s, e, data, seed):
    """The routing kernel's CUDA C, built for the CPU, gives NumPy's mask, one thread per block
    and with a team of threads (barriers), ties included."""
    from hspmd.codegen.cpu_compile import load_library
    from hspmd.runtime.kernel_exec import build_program, cpu_call, program_library

    top_k, capacity = data.draw(st.integers(1, e)), data.draw(st.integers(1, 4))
    dt = data.draw(st.sampled_from(["f32", "f64"]))
    module, op = _route_kernel(g, s, e, top_k, capacity, dt)
    probs = np.random.default_rng(seed).dirichlet(np.ones(e), size=(g, s))
    if data.draw(st.booleans()):
        probs = np.round(probs, 1)
    probs = probs.astype(np.float32 if dt == "f32" else np.float64)
    expect = moe_route(probs, top_k, capacity)
    np.testing.assert_array_equal(cpu_call(op, program_library(module))(probs), expect)
    team = load_library(build_program(module, team=True))
    np.testing.assert_array_equal(cpu_call(op, team, 4)(probs), expect)


def test_route_kernel_compiles_for_gpus():
    from hspmd.codegen.nvrtc_check import check_module, nvrtc_status

    ok, why = nvrtc_status()
    if not ok:
        pytest.skip(f"NVRTC: {why}")
    module, _ = _route_kernel(4, 64, 8, 2, 16, "f32")
    assert all(size > 0 for size in check_module(module).values())


def _moe_plan(moe: hs.nn.MoE, shape, seed: int):
    """Return (plan, batch) of `loss = sum(moe(x)[0] * c) + aux`, x and c random inputs."""
    t = Tracer()
    rng = np.random.default_rng(seed)
    batch = {"x": rng.standard_normal(shape), "c": rng.standard_normal(shape)}
    with bind_parameters(moe, t):
        x = t.parameter("x", shape, "zeros", "float64")  # a parameter, to get its gradient
        y, aux = moe(x)
        t.output("y", y)
        t.output("aux", aux)
        t.output("loss", (y * t.input("c", shape, "float64")).sum() + aux)
    return compile_plan(t.finish()), batch


def _torch_moe(state: dict[str, np.ndarray], c: np.ndarray, moe: hs.nn.MoE):
    """The same layer in PyTorch (the mask from the plain-loop routing): y, aux and the gradients."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in state.items()}
    x = p["x"]
    b, t, d = x.shape
    probs = torch.softmax(x @ p["router"], -1)
    mask = torch.tensor(route_by_loop(probs.detach().numpy(), moe.top_k, moe.capacity(t)))
    slots = torch.einsum("gsd,gsec->egcd", x, mask).reshape(moe.experts, -1, d)
    h = torch.nn.functional.gelu(torch.bmm(slots, p["w1"]), approximate="tanh")
    out = torch.bmm(h, p["w2"]).reshape(moe.experts, b, -1, d)
    y = torch.einsum("egcd,gsec->gsd", out, mask * probs[..., None])
    f = mask.sum(dim=(1, 3)) / (t * moe.top_k)
    aux = moe.experts * (f * probs.mean(dim=1)).sum(dim=1).mean()
    ((y * torch.tensor(c)).sum() + aux).backward()
    return y.detach().numpy(), aux.item(), {k: v.grad.numpy() for k, v in p.items()}


@pytest.mark.parametrize("experts,top_k,factor", [(4, 1, 1.0), (4, 2, 0.5), (3, 2, 2.0), (1, 1, 1.0)])
def test_moe_layer_equals_pytorch(experts, top_k, factor):
    moe = hs.nn.MoE(6, 5, experts=experts, top_k=top_k, capacity_factor=factor, init_std=0.5)
    for p in moe.parameters():
        p.dtype = "float64"
    plan, batch = _moe_plan(moe, (3, 7, 6), seed=experts + top_k)
    state = plan.initial_state(1)
    state["x"] = batch["x"]
    ref_state = {k: v.copy() for k, v in state.items()}
    out = plan.run(state, plan.local_batch(batch))
    y, aux, grads = _torch_moe(ref_state, batch["c"], moe)
    np.testing.assert_allclose(out["y"], y, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out["aux"], aux, rtol=1e-10)
    for name, g in grads.items():
        np.testing.assert_allclose(out[f"grad:{name}"], g, rtol=1e-8, atol=1e-10, err_msg=name)
    if factor < 1:  # the case drops tokens: some choice found its expert full
        probs = torch.softmax(torch.tensor(ref_state["x"]) @ torch.tensor(ref_state["router"]), -1).numpy()
        assert route_by_loop(probs, top_k, moe.capacity(7)).sum() < 3 * 7 * top_k


# ----------------------------------------------------------------------------- expert parallelism


@settings(max_examples=12, deadline=None)
@given(experts=st.sampled_from([2, 4]), data=st.data(), seed=st.integers(0, 2**16),
       mesh=st.sampled_from([(1, 2, 1), (2, 2, 1), (1, 4, 1), (1, 2, 2), (2, 2, 2)]))
def test_random_routing_under_expert_parallelism_equals_one_device(experts, data, seed, mesh):
    """The MoE layer (loss, y, aux, every gradient) with random router weights, top-k and
    capacity, the batch split over dp*ep ranks and the experts over ep (and over tp, w1 along
    its output dim, w2 along its input dim, as `ep` with `tp` lays them out), equals one device."""
    dp, ep, tp = mesh
    if experts % ep:
        ep, dp = 2, mesh[0] * mesh[1] // 2
    n = dp * ep * tp
    top_k = data.draw(st.integers(1, experts))
    factor = data.draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))
    moe = hs.nn.MoE(4, 6, experts=experts, top_k=top_k, capacity_factor=factor, init_std=1.0)
    for p in moe.parameters():
        p.dtype = "float64"
    t = Tracer()
    rng = np.random.default_rng(seed)
    shape = (4, 6, 4)
    batch = {"x": rng.standard_normal(shape), "c": rng.standard_normal(shape)}
    with bind_parameters(moe, t):
        y, aux = moe(t.input("x", shape, "float64"))
        t.output("y", y)
        t.output("aux", aux)
        t.output("loss", (y * t.input("c", shape, "float64")).sum() + aux)
    logical = t.finish()
    run_passes(logical, "autodiff")
    devices = range(n)
    tokens = Layout.spmd(devices, DistributedStates.of((split(0), dp * ep), (DUP, tp)))

    def experts_layout(tp_dim):
        return Layout.spmd(devices, DistributedStates.of(
            *[(a, d) for a, d in ((DUP, dp), (split(0), ep), (split(tp_dim), tp)) if d > 1]))

    layouts = {"x": tokens, "c": tokens, "router": Layout.replicated(devices), "w1": experts_layout(2),
               "w2": experts_layout(1)}
    (ref,) = run_step(compile_step(logical, {k: Layout.replicated((0,)) for k in layouts}), 1, batch)
    physical = compile_step(logical, layouts)
    assert any(o.name == "comm.all_to_all" for o in physical.walk())
    check_outputs(run_step(physical, n, batch), ref,
                  f"MoE E={experts} top_k={top_k} c={factor} on dp={dp} ep={ep} tp={tp}")


_reference: dict[tuple, object] = {}


def _script(extra=()):
    return load_script(MOE, parse_overrides([*SMALL, f"steps={STEPS}", *extra]))


def _train(tmp_path, strategy: str, n: int, extra=()):
    bundle = tmp_path / f"moe-{n}-{abs(hash((strategy, tuple(extra))))}"
    write_bundle(compile_script(_script(extra), strategy, n), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=STEPS, quiet=True, keep_outputs=True),
                    timeout=300)


def _check_equal(tmp_path, strategy: str, n: int, extra=()):
    key = tuple(extra)
    if key not in _reference:
        _reference[key] = _train(tmp_path, "[0]: dp=1", 1, extra)[0]
    ref = _reference[key]
    ranks = _train(tmp_path, strategy, n, extra)
    for got in ranks:
        assert len(got.losses) == STEPS
        np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    for name, value in ref.params.items():
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-5, atol=5e-5, err_msg=name)


#: every strategy of the in-process sweep; a run tests one of each kind (`_ep_kind`)
EP_STRATEGIES = [(2, "[0,1]: ep=2"), (4, "[0-3]: dp=2 ep=2"), (4, "[0-3]: ep=4"), (4, "[0-3]: ep=2 tp=2"),
                 (4, "[0-3]: ep=2 pp=2"), (8, "[0-7]: dp=2 ep=2 tp=2"), (2, "[0,1]: ep=2 zero=1"),
                 (4, "[0-3]: dp=2 ep=2 zero=1"), (8, "[0-7]: dp=2 ep=2 tp=2 zero=2"),
                 (5, "[0-3]: ep=2 pp=2 | [4]: dp=1"), (4, "[0-3]: dp=2 ep=2 zero=3"),
                 (2, "[0,1]: ep=2 zero=3 recompute=block"), (8, "[0-7]: dp=2 ep=2 tp=2 zero=3")]


def _ep_kind(case) -> str:
    """The path a strategy tests beside ep: ZeRO 3, ZeRO 1/2, a pipeline, tp, dp, or ep alone."""
    return next(k for k in ("zero=3", "zero", "pp=", "tp=", "dp=", "") if k in case[-1])


@pytest.mark.parametrize("n,strategy", sampled_kinds(EP_STRATEGIES, _ep_kind, "moe-ep"))
def test_expert_parallel_equals_one_device(tmp_path, n, strategy):
    """A run tests one strategy of each kind (`_ep_kind`) of `EP_STRATEGIES`, sampled by its seed."""
    _check_equal(tmp_path, strategy, n)


UNEVEN_PLACEMENTS = ["[0,1]: ep=2 experts=6 | [2]: ep=1 experts=2",
                     "[0,1]: ep=2 experts=6 share=3 | [2]: experts=2 share=1",
                     "[0]: experts=2 | [1,2]: ep=2 experts=6",
                     "[0,1]: ep=2 share=3 | [2]: dp=1 share=1",
                     "[0,1]: ep=2 experts=6 zero=1 | [2]: ep=1 experts=2",
                     "[0,1]: ep=2 experts=6 zero=3 | [2]: ep=1 experts=2"]


def _placement_kind(strategy: str) -> str:
    return next(k for k in ("zero=", "share=", "") if k in strategy)


@pytest.mark.parametrize("strategy", sampled_kinds(UNEVEN_PLACEMENTS, _placement_kind, "moe-uneven"))
def test_uneven_expert_placement_equals_one_device(tmp_path, strategy):
    """Unlike groups hold different numbers of experts (split across groups by experts=, as the
    batch is by share=): the tokens reach them by uneven exchanges. A run tests one placement of
    each kind (plain, with shares, with ZeRO), sampled by its seed."""
    _check_equal(tmp_path, strategy, 3, ["model.experts=8"])


@pytest.mark.parametrize("n,strategy", [(5, "[0-3]: dp=2 ep=2 experts=6 zero=1 | [4]: experts=2"),
                                        (9, "[0-7]: dp=2 ep=2 tp=2 experts=4 zero=1 | [8]: experts=4")])
def test_uneven_expert_placement_with_zero_and_tp_equals_one_device(tmp_path, n, strategy):
    """A group with dp, ep (and tp) and ZeRO beside a one-device group, each holding its own experts."""
    _check_equal(tmp_path, strategy, n, ["model.experts=8"])


def test_uneven_expert_placement_layout_and_errors():
    compiled = compile_script(_script(["model.experts=8"]), "[0,1]: ep=2 experts=6 | [2]: ep=1 experts=2", 3)
    lay = {o.tensor_name.data: str(layout_of(o.result)) for o in compiled.annotated.walk()
           if isinstance(o, graph.ParameterOp)}
    assert lay["blocks.1.moe.w1"] == "[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1"
    with pytest.raises(PassError, match=r"places 6\+2 = 8 experts but expert weight 'blocks.1.moe.w1' has 4"):
        compile_script(_script(), "[0,1]: ep=2 experts=6 | [2]: ep=1 experts=2", 3)


def test_mixed_precision_moe_under_ep_follows_one_device(tmp_path):
    """bfloat16 compute (float32 master weights, the aux loss cast to the loss's float32):
    ep=2 stays within bfloat16's rounding of one device."""
    ref = _train(tmp_path, "[0]: dp=1", 1, ["precision=bfloat16"])[0]
    got = _train(tmp_path, "[0,1]: ep=2", 2, ["precision=bfloat16"])[0]
    assert all(math.isfinite(v) for v in got.losses)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=2e-3)


def test_expert_parallel_in_a_pipeline_with_microbatches_equals_one_device(tmp_path):
    _check_equal(tmp_path, "[0-3]: ep=2 pp=2", 4, ["microbatches=2"])


def test_expert_weights_are_split_and_tokens_move_by_all_to_all():
    compiled = compile_script(_script(), "[0-3]: dp=2 ep=2", 4)
    lay = {o.tensor_name.data: str(layout_of(o.result)) for o in compiled.annotated.walk()
           if isinstance(o, graph.ParameterOp)}
    assert lay["blocks.1.moe.w1"] == lay["blocks.1.moe.w2"] == "[0-3]: dup=2, split(0)=2"
    assert lay["opt.m.blocks.1.moe.w1"] == "[0-3]: dup=2, split(0)=2"  # Adam's state follows
    assert lay["blocks.1.moe.router"] == "[0-3]: dup=4"
    comms = [o for o in compiled.physical.walk() if o.name.startswith("comm.")]
    a2a = [o for o in comms if o.name == "comm.all_to_all"]
    assert len(a2a) >= 4  # into and out of the experts, forward and backward
    assert all(sorted(map(tuple, o.rank_groups)) == [(0, 1), (2, 3)] for o in a2a)  # inside ep pairs
    assert not [o for o in comms if o.name == "comm.all_gather"]  # no gathered tokens or weights


def test_ep_with_dp_and_tp_splits_experts_over_tp_and_zero_shards_their_states_over_dp():
    """`[0-7]: dp=2 ep=2 tp=2 zero=1`: an expert weight is split over ep (dim 0) and tp (w1 column-
    parallel along F, w2 row-parallel along F), replicated over dp; ZeRO splits its Adam states
    over dp along a free dim, and the other parameters' states over all dp*ep batch ranks."""
    compiled = compile_script(_script(), "[0-7]: dp=2 ep=2 tp=2 zero=1", 8)
    lay = {o.tensor_name.data: str(layout_of(o.result)) for o in compiled.annotated.walk()
           if isinstance(o, graph.ParameterOp)}
    assert lay["blocks.1.moe.w1"] == "[0-7]: dup=2, split(0)=2, split(2)=2"
    assert lay["blocks.1.moe.w2"] == "[0-7]: dup=2, split(0)=2, split(1)=2"
    assert lay["opt.m.blocks.1.moe.w1"] == "[0-7]: split(1)=2, split(0)=2, split(2)=2"
    assert lay["opt.v.blocks.1.moe.w2"] == "[0-7]: split(2)=2, split(0)=2, split(1)=2"
    assert lay["blocks.1.moe.router"] == "[0-7]: dup=8"
    assert lay["opt.m.blocks.1.moe.router"] == "[0-7]: split(0)=4, dup=2"
    a2a = [o for o in compiled.physical.walk() if o.name == "comm.all_to_all"]
    assert a2a and all(len(g) == 2 for o in a2a for g in o.rank_groups)  # tokens move inside ep pairs


def test_zero3_under_ep_holds_the_expert_slices_and_gathers_them_over_dp_only():
    """`[0-7]: dp=2 ep=2 tp=2 zero=3`: an expert weight (split over ep and tp) holds the slice its
    states hold (its dup axis, dp, split along a free dim) and is all-gathered over the dp pairs
    only, where a layer computes with it; a replicated parameter holds 1/(dp*ep) of itself."""
    compiled = compile_script(_script(), "[0-7]: dp=2 ep=2 tp=2 zero=3", 8)
    lay = {o.tensor_name.data: str(layout_of(o.result)) for o in compiled.annotated.walk()
           if isinstance(o, graph.ParameterOp)}
    assert lay["blocks.1.moe.w1"] == lay["opt.m.blocks.1.moe.w1"] == "[0-7]: split(1)=2, split(0)=2, split(2)=2"
    assert lay["blocks.1.moe.router"] == lay["opt.m.blocks.1.moe.router"] == "[0-7]: split(0)=4, dup=2"
    (_, group), *_ = physical_groups(compiled.physical)
    dp_pairs = {(0, 4), (1, 5), (2, 6), (3, 7)}
    piece = (2, 16, 16)  # w1, w2 [E=4, D=32, F=32] over ep, tp and dp
    expert_gathers = [o for o in group.walk() if o.name == "comm.all_gather"
                      and tuple(o.operands[0].type.get_shape()) == piece]
    assert len(expert_gathers) == 4  # each weight in its layer's forward and again in its backward
    assert all({tuple(g) for g in o.rank_groups} == dp_pairs for o in expert_gathers)


def test_compile_report_lists_the_all_to_alls_with_bytes():
    proc = run_cli("hspmd", "compile", MOE, "--strategy", "[0,1]: ep=2", "--report", timeout=300, check=True)
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("comm.all_to_all")]
    assert len(rows) == 4  # tokens into and out of the experts, and their gradients
    # [E, B, C, D] = [4, 16, 32, 64] floats, half of each rank's piece to the other rank
    assert all(r[-1] == "131,072" for r in rows)
    assert "comm.all_to_all 4)" in proc.stdout


def test_experts_that_ep_does_not_divide_get_one_message():
    with pytest.raises(PassError, match=r"ep cannot split parameter 'blocks.1.moe.w1'.*expert dim"):
        compile_script(_script(["model.experts=3"]), "[0,1]: ep=2", 2)


@pytest.mark.parametrize("strategy,message", [
    ("[0-3]: ep=3", "dp*tp*pp*ep = 1*1*1*3 = 3 but 4 devices"),
    ("[0-3]: ep=2 pp=2 zero=1", "ZeRO (zero=1) with expert parallelism (ep=2) in a pipeline (pp=2), which is not "
                                "supported yet"),
    ("[0,1]: ep=2 experts=3 | [2,3]: experts=1", "experts=3; a group's experts must be an integer >= 1 that its ep=2"),
    ("[0,1]: ep=2 experts=2 | [2,3]: dp=2", "gives experts= for some groups only"),
])
def test_cli_bad_ep_is_one_message(strategy, message):
    proc = run_cli("hspmd", "compile", MOE, "-n", "4", "--strategy", strategy, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert message in proc.stderr + proc.stdout


_mpi_reference: dict[str, list[float]] = {}


def _mpi_losses(tmp_path, n: int, strategy: str, experts: str) -> list[float]:
    sets = [a for kv in [*SMALL, f"model.experts={experts}"] for a in ("--set", kv)]
    log = tmp_path / f"moe-{n}-{len(list(tmp_path.iterdir()))}.jsonl"
    run_cli("hspmd", "run", "-n", str(n), MOE, "--strategy", strategy, "--steps", "6", "--log", str(log), *sets,
            check=True, timeout=600)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


#: `hspmd run` over mpiexec: the in-process tests above check each strategy's numbers; this sweep
#: checks the command's path, so a run tests the uneven placement and one of the others
MPI_STRATEGIES = [
    (2, "[0,1]: ep=2", "4"), (4, "[0-3]: dp=2 ep=2", "4"), (4, "[0-3]: ep=2 tp=2", "4"), (4, "[0-3]: ep=2 pp=2", "4"),
    (4, "[0-3]: dp=2 ep=2 zero=1", "4"), (4, "[0-3]: dp=2 ep=2 zero=3", "4"),
    (3, "[0,1]: ep=2 experts=6 | [2]: ep=1 experts=2", "8"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("n,strategy,experts", sampled_kinds(MPI_STRATEGIES, lambda c: c[2], "moe-mpi"))
def test_moe_over_mpi_logs_the_single_device_losses(tmp_path, n, strategy, experts):
    """A run tests the uneven placement (8 experts) and one strategy of 4 experts, sampled by its seed."""
    if experts not in _mpi_reference:
        _mpi_reference[experts] = _mpi_losses(tmp_path, 1, "[0]: dp=1", experts)
    got = _mpi_losses(tmp_path, n, strategy, experts)
    assert len(got) == 6 and all(math.isfinite(v) for v in got)
    np.testing.assert_allclose(got, _mpi_reference[experts], rtol=1e-5, err_msg=strategy)


@pytest.mark.mpi
@pytest.mark.parametrize("n,strategy", [(2, "[0,1]: ep=2"), (4, "[0-3]: dp=2 ep=2 zero=1")])
def test_a_checkpoint_saved_under_ep_resumes_on_one_device(tmp_path, n, strategy):
    """Sharded checkpoints hold each rank's experts (and, with ZeRO, its slices of their Adam
    states); one device reads them back whole and goes on with the numbers of a run that never
    stopped."""
    sets = [a for kv in SMALL for a in ("--set", kv)]
    ck, log, ref = tmp_path / "ck", tmp_path / "resumed.jsonl", tmp_path / "ref.jsonl"
    run_cli("hspmd", "run", "-n", str(n), MOE, "--strategy", strategy, "--steps", "2", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "2", *sets, check=True, timeout=600)
    run_cli("hspmd", "run", "-n", "1", MOE, "--steps", "3", "--resume", str(ck), "--log", str(log), *sets,
            check=True, timeout=600)
    run_cli("hspmd", "run", "-n", "1", MOE, "--steps", "3", "--log", str(ref), *sets, check=True, timeout=600)
    last = [json.loads(f.read_text().splitlines()[-1])["loss"] for f in (log, ref)]
    np.testing.assert_allclose(last[0], last[1], rtol=1e-6)


def test_annotations_read_dp_as_the_batch_axis_under_ep():
    """`hs.annotate(x, ("dp", ...))` splits the batch as the strategy does: over dp*ep ranks."""
    from hspmd.ir.strategy import parse_strategy
    from hspmd.transforms.apply_annotations import spec_layout

    assert str(spec_layout(parse_strategy("[0-3]: dp=2 ep=2"), ("dp", None))) == "[0-3]: split(0)=4"
    assert str(spec_layout(parse_strategy("[0-3]: ep=2 tp=2"), ("dp", "tp"))) == "[0-3]: split(0)=2, split(1)=2"
    assert str(spec_layout(parse_strategy("[0-3]: dp=2 ep=2"), (None, None))) == "[0-3]: dup=4"
