"""How far below PyTorch eager can a GPT-tiny step go here: its linear layers' products alone.

    python benchmarks/step_floor.py [--steps 12] [--warmup 3] [--threads N]

`step_vs_torch.py` compares hspmd's whole step with PyTorch eager. This script measures the
part of that step that no scheduling or fusion can remove: the linear layers' products
(forward, input and weight gradients, the LM head; 39.4 GFLOP of GPT-tiny's 42.7), run as
the plan runs them (the same calls, operands, `out=` buffers, pairs on two threads) back to
back, in the step's order, with nothing between them. Three runners take turns step by
step, as in `step_vs_torch.py`: hspmd's whole step, the products alone, PyTorch eager (in a
process of its own with PyTorch's defaults, `torch_peer.py`, as its users run it).

Printed: the three medians; the products' FLOP rate alone and in the step, against NumPy's
rate on the largest shape; the rest of hspmd's step (step - products alone: attention,
fused kernels, sums, optimizer); the time that a step of 0.70 x eager would leave for that
rest; and last the ratio products alone / PyTorch eager, the lowest step / eager ratio
that OpenBLAS-rate products allow before anything else runs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402  (first: it keeps the environment as this process found it, for the peer)

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "8")  # as step_vs_torch.py (before NumPy loads)

import numpy as np  # noqa: E402

import step_vs_torch as svt  # noqa: E402

#: plan step labels of the products that stay outside batch chains (attention's are inside)
_PRODUCTS = ("graph.matmul", "graph.matmul_rhs_grad")


def linear_flops(fn) -> int:
    """Return the FLOPs of the step's products with a 2-D weight (linear layers, LM head)."""
    from hspmd.codegen.schedule.analysis import op_matmul_flops
    from hspmd.codegen.schedule.flatten import flatten
    from hspmd.dialects import graph

    total = 0
    for node in flatten(fn).nodes:
        op = node.op
        if isinstance(op, graph.MatmulOp) and len(op.operands[1].type.get_shape()) == 2:
            total += op_matmul_flops(op)
        elif isinstance(op, graph.MatmulRhsGradOp) and len(op.results[0].type.get_shape()) == 2:
            total += op_matmul_flops(op)
    return total


class Products:
    """The plan's product steps of one recorded step, replayed back to back."""

    def __init__(self, ours: "svt.Hspmd", batch) -> None:
        plan = ours.plan
        self.calls: list = []
        index = [i for i, label in enumerate(plan.labels) if label is not None and label.name in _PRODUCTS]
        saved = {i: plan.steps[i] for i in index}
        for i in index:
            fn, args, outs, kw, dead = plan.steps[i]
            plan.steps[i] = (self._recording(fn), args, outs, kw, dead)
        try:
            ours.step(batch)
        finally:
            for i, step in saved.items():
                plan.steps[i] = step
        if not self.calls:
            raise SystemExit("step_floor: the plan has no product steps")

    def _recording(self, fn):
        def record(*args, **kw):
            # the operands stay referenced: later steps may write their buffers, which changes
            # values, not the time of a product
            self.calls.append((fn, args, dict(kw)))
            return fn(*args, **kw)
        return record

    def step(self, batch=None) -> None:
        for fn, args, kw in self.calls:
            fn(*args, **kw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (default 3)")
    parser.add_argument("--threads", type=int, help="threads for both (default: each its own default)")
    args = parser.parse_args()
    if args.threads is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads, user_api="blas")
        torch_peer.START_ENV.update(OMP_NUM_THREADS=str(args.threads))
    import tempfile

    from hspmd.runtime.stacked import per_layer

    script, compiled, fn = svt.compile_tiny()
    ours = svt.Hspmd(script, compiled, fn, args.threads)
    all_batches = script.batches()
    batch_list = [next(all_batches) for _ in range(2 + args.warmup + args.steps)]
    with tempfile.TemporaryDirectory(prefix="step-floor-") as data:
        torch_peer.write_inputs(data, svt.torch_settings(script),
                                per_layer({k: v.copy() for k, v in ours.state.items()}), batch_list)
        peer = torch_peer.Peer(data)
        try:
            return _measure(args, script, ours, fn, peer, iter(batch_list[1:]))
        finally:
            peer.close()


def _measure(args, script, ours, fn, peer, batches) -> int:
    """Time the three runners alternately and print the results (see the module docstring)."""
    products = Products(ours, next(batches))
    flops = linear_flops(fn)
    runners = {"step": ours, "products": products, "torch": svt.PeerRunner(peer)}
    for _ in range(args.warmup):
        batch = next(batches)
        for runner in runners.values():
            runner.step(batch)
    t_mm: list[float] = []
    d_model, seq = script.config["model"]["d_model"], script.config["model"]["seq_len"]
    rows = script.config["data"]["batch_size"] * seq

    def numpy_product() -> None:  # NumPy's rate: the faster of BLAS's threads and one thread
        t_mm.append(min(svt.numpy_matmul_seconds(rows, d_model, 4 * d_model),
                        svt.numpy_matmul_seconds(rows, d_model, 4 * d_model, threads=1)))

    times = svt.alternate(runners, batches, args.steps, numpy_product)
    med = {name: float(np.median(t)) for name, t in times.items()}
    numpy_rate = 2 * rows * d_model * 4 * d_model / float(np.median(t_mm))
    print(f"GPT-tiny, {len(products.calls)} product steps of the plan ({flops / 1e9:.2f} GFLOP of linear layers), "
          f"{args.steps} steps each, alternating; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"median: hspmd step {med['step'] * 1e3:.1f} ms, its products alone {med['products'] * 1e3:.1f} ms, "
          f"PyTorch eager {med['torch'] * 1e3:.1f} ms (its own process, its defaults)")
    print(f"products' rate: alone {flops / med['products'] / 1e9:.1f} GFLOP/s, NumPy on "
          f"{rows}x{d_model} @ {d_model}x{4 * d_model} {numpy_rate / 1e9:.1f} GFLOP/s "
          f"(alone / NumPy {flops / med['products'] / numpy_rate:.3f})")
    rest = med["step"] - med["products"]
    budget = 0.70 * med["torch"] - med["products"]
    print(f"the rest of hspmd's step (attention, fused kernels, sums, optimizer; step - products alone): "
          f"{rest * 1e3:.1f} ms; a step of 0.70 x eager leaves it {budget * 1e3:.1f} ms")
    print(f"step time hspmd / PyTorch eager: {med['step'] / med['torch']:.3f}; "
          f"products alone / PyTorch eager: {med['products'] / med['torch']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
