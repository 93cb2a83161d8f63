"""GPT training steps on one GPU with flash attention (`flash-attention`) against without it.

    python benchmarks/gpu_flash_attention.py [--sizes tiny,medium,long] [--steps 20] [--warmup 3]

Sizes: tiny (L2 d128 h4 T64 B16, the example's), medium (L6 d512 h8 T256 B16), long (L2 d512 h8
T1024 B8), dropout 0.1. Both plans (the same compiled step; its GPU program with and without the
pass) run on one device, taking turns step by step; each step is timed to its end (the loss read
back). Printed per size: the median step times and their ratio (flash / unfused), the arenas and
their ratio, whether the losses agree (rtol 1e-4) and the CUDA graphs each plan captured; last,
the ratio at the last size. Needs CuPy and a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = {
    "tiny": {"model.layers": 2, "model.d_model": 128, "model.heads": 4, "model.seq_len": 64, "data.batch_size": 16},
    "medium": {"model.layers": 6, "model.d_model": 512, "model.heads": 8, "model.seq_len": 256, "data.batch_size": 16},
    "long": {"model.layers": 2, "model.d_model": 512, "model.heads": 8, "model.seq_len": 1024, "data.batch_size": 8},
}


def run_size(size: str, steps: int, warmup: int) -> float:
    from hspmd.compiler import compile_script, device_level
    from hspmd.frontend.script import load_script
    from hspmd.runtime.cuda.cupy_device import CupyDevice
    from hspmd.runtime.cuda.plan import build_device_plan
    from hspmd.runtime.worker import step_inputs

    script = load_script(os.path.join(ROOT, "examples", "gpt.py"), {**SIZES[size], "model.dropout": 0.1})
    compiled = compile_script(script, "[0]: dp=1", 1)
    device = CupyDevice(0)
    config = {**script.config, "lr_schedule": compiled.lr_schedule}
    runs = {}
    for name, flash in (("unfused", False), ("flash", True)):
        ((_, program),) = device_level(compiled.kernel_groups(), flash=flash)
        fn = next(op for op in program.body.block.ops if getattr(op, "sym_name", None) is not None
                  and op.sym_name.data == "train_step")
        plan = build_device_plan(fn, 0, device)
        runs[name] = (plan, plan.initial_state(0), {leaf.name for leaf in plan.inputs})
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    batches = script.batches()
    for i in range(1, warmup + steps + 1):
        batch = next(batches)
        for name in (list(runs) if i % 2 else list(reversed(runs))):
            plan, state, names = runs[name]
            inputs = plan.local_batch({**batch, **step_inputs(i, config, names)})
            start = time.perf_counter()
            loss = float(plan.run(state, inputs)["loss"])
            if i > warmup:
                times[name].append(time.perf_counter() - start)
            losses[name].append(loss)
    t = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    arena = {name: runs[name][0].peak_bytes / 2**20 for name in runs}
    agree = np.allclose(losses["flash"], losses["unfused"], rtol=1e-4)
    print(f"{size:7s} step unfused {t['unfused']:8.2f} ms, flash {t['flash']:8.2f} ms, flash/unfused "
          f"{t['flash'] / t['unfused']:.2f}x | arena {arena['unfused']:8.1f} -> {arena['flash']:8.1f} MiB "
          f"({arena['flash'] / arena['unfused']:.2f}x) | losses agree: {agree} | CUDA graphs captured "
          f"{runs['unfused'][0].graphs_captured}, {runs['flash'][0].graphs_captured}", flush=True)
    return t["flash"] / t["unfused"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,medium,long")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    from hspmd.codegen.cupy_backend import gpu_status

    ok, why = gpu_status()
    if not ok:
        print(f"needs CuPy and a CUDA GPU: {why}")
        return 2
    sizes = args.sizes.split(",")
    ratio = float("nan")
    for size in sizes:
        ratio = run_size(size, args.steps, args.warmup)
    print(f"headline: flash / unfused step time, {sizes[-1]}: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
