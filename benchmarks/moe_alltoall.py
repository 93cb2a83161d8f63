"""Expert parallelism's all-to-alls: bytes sent against the routed tokens' minimum, and ep=2 vs dp=2.

    python benchmarks/moe_alltoall.py [--steps 12]

examples/moe.py (GPT, 2 blocks, the second a mixture of 4 experts, top-2, capacity factor 1.0,
16 sequences of 64 tokens per step) on 2 ranks. The benchmark

1. compiles `[0,1]: ep=2` and sums, from the compiler's collective report (`hspmd compile
   --report`), the bytes one rank sends per step in its all-to-alls;
2. trains the model on one device for `--steps` steps, recording every routing mask the
   `graph.moe_route` kernel makes (a wrapper around the NumPy kernel, in this process only),
   and counts the **minimum**: under ep=2 rank r holds sequences [8r, 8r+8) and experts
   {2r, 2r+1}; every kept (token, expert) choice whose expert is on the other rank must cross
   once into the experts and once back in the forward pass, and its gradient twice in the
   backward pass, d_model floats each. The ratio is the all-to-alls' bytes over that minimum,
   rank 0's, averaged over the steps; it is above 1 by the empty capacity slots the fixed-size
   all-to-alls carry (tokens dropped or experts under capacity);
3. runs `[0,1]: ep=2` and `[0,1]: dp=2` over MPI (`hspmd run -n 2`) for `--steps` steps each
   and prints their median step times (the first 2 dropped) and ep=2 / dp=2.

The last line ends with sent / minimum (the bytes ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPT = os.path.join(ROOT, "examples", "moe.py")
HSPMD = os.path.join(os.path.dirname(sys.executable), "hspmd")
EP = "[0,1]: ep=2"


def alltoall_bytes(strategy: str, ranks: int) -> tuple[int, int]:
    """Return (bytes rank 0 sends per step in all-to-alls, their number) under `strategy`."""
    from hspmd.codegen.report import collective_report
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script

    compiled = compile_script(load_script(SCRIPT), strategy, ranks)
    rows = [r for r in collective_report(compiled.physical) if r.op == "comm.all_to_all" and 0 in r.devices]
    return sum(r.bytes_per_step for r in rows), sum(r.calls for r in rows)


def routed_minimum(steps: int, directory: str) -> tuple[float, float]:
    """Return (rank 0's minimum bytes per step for its routed tokens, the fraction of choices kept)."""
    from hspmd.compiler import compile_script, write_bundle
    from hspmd.frontend.script import load_script
    from hspmd.dialects.graph import moe
    from hspmd.runtime.comm import run_spmd
    from hspmd.runtime.worker import train

    script = load_script(SCRIPT)
    model = script.config["model"]
    d, experts, top_k = model["d_model"], model["experts"], model["top_k"]
    masks: list[np.ndarray] = []
    route = moe.moe_route_values

    def recording(probs, k, capacity):
        mask = route(probs, k, capacity)
        masks.append(mask)
        return mask

    bundle = os.path.join(directory, "one")
    write_bundle(compile_script(script, "[0]: dp=1", 1), bundle)
    moe.moe_route_values = recording
    try:
        run_spmd(1, lambda comm: train(bundle, comm, steps=steps, quiet=True), timeout=600)
    finally:
        moe.moe_route_values = route
    if not masks:
        raise SystemExit("no routing mask was recorded")
    layers = len(masks) // steps
    total = kept = 0.0
    for mask in masks:  # [B, T, E, C]: rank 0 holds the first half of the sequences and experts
        mine = mask[: mask.shape[0] // 2]
        total += 4 * d * 4 * float(mine[:, :, experts // 2:].sum())  # 4 crossings, float32
        kept += float(mask.sum()) / (mask.shape[0] * mask.shape[1] * top_k)
    return total / steps, kept / (steps * layers)


def median_step(strategy: str, steps: int, directory: str) -> float:
    log = os.path.join(directory, f"{strategy.split(':')[1].strip().replace('=', '')}.jsonl")
    proc = subprocess.run([HSPMD, "run", "-n", "2", SCRIPT, "--strategy", strategy, "--steps", str(steps),
                           "--log", log], capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"hspmd run '{strategy}' failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    times = [json.loads(line)["time_s"] for line in open(log) if line.startswith("{")]
    return statistics.median(times[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12; the first 2 timed out)")
    args = parser.parse_args()
    sent, calls = alltoall_bytes(EP, 2)
    four, _ = alltoall_bytes("[0-3]: dp=2 ep=2", 4)
    print(f"{EP}: {calls} all-to-alls per step, {sent:,} bytes per rank per step "
          f"([0-3]: dp=2 ep=2: {four:,})")
    with tempfile.TemporaryDirectory(prefix="hspmd-moebench-") as directory:
        minimum, kept = routed_minimum(args.steps, directory)
        print(f"routed tokens: {kept:.3f} of the top-k choices kept; minimum for rank 0's routed tokens "
              f"{minimum:,.0f} bytes per step")
        ep = median_step(EP, args.steps, directory)
        dp = median_step("[0,1]: dp=2", args.steps, directory)
        print(f"step time: ep=2 {ep * 1e3:.1f} ms, dp=2 {dp * 1e3:.1f} ms; ep=2 / dp=2 {ep / dp:.3f}")
    print(f"all-to-all bytes per rank per step {sent:,}, minimum for the routed tokens {minimum:,.0f}; "
          f"sent / minimum {sent / minimum:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
