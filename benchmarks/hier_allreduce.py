"""Two-tier against flat all-reduces on 2 simulated nodes of 2 ranks, with a slow link between them.

    python benchmarks/hier_allreduce.py [--link 50:0.117] [--mib 8] [--steps 8] [--reps 2]

The link between the simulated nodes is `--link latency_us:GB/s` (default: 1 Gb Ethernet as
measured between two hosts, 50 us and 117 MB/s; `hspmd.runtime.comm.slow_link`).

1. **Bytes and bits.** 4 MPI ranks under the wheel's mpiexec, nodes {0,1} and {2,3}: one
   all-reduce of `--mib` MiB of float32, flat (`MPICommunicator`) and in two tiers
   (`NodeCommunicator`), each through `SlowLinks`, which counts what crosses nodes. The two
   results must be equal bit for bit; the cross-node bytes of the two-tier form / the flat form's
   (target <= 1/g + 5% = 0.55), and their times.
2. **Step time.** `hspmd run -n 4 --ranks-per-node 2` of a GPT whose gradients outweigh its
   compute (2 layers of width 512, 4 sequences of 16 tokens a step) under `[0-3]: dp=4`, with
   `HSPMD_SLOW_LINK` set, in two tiers and flat (`HSPMD_NODE_COLLECTIVES=flat`), alternately,
   `--reps` runs each; the median step time (the plan's, which waits for the gradient sums) of the
   steps after the first two. The headline, last: two-tier / flat (target <= 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
NODES = [0, 0, 1, 1]
MODEL = ["examples/gpt.py", "--set", "model.layers=2", "--set", "model.d_model=512", "--set", "model.seq_len=16",
         "--set", "data.batch_size=4"]


def child(mib: float, latency: float, rate: float) -> int:
    from mpi4py import MPI

    from hspmd.runtime.comm.mpi import MPICommunicator
    from hspmd.runtime.comm.nodes import NodeCommunicator
    from hspmd.runtime.comm.slow_link import SlowLinks

    comm = MPICommunicator()
    group = tuple(range(comm.size))
    x = np.random.default_rng(comm.rank).standard_normal(int(mib * 2**20) // 4).astype(np.float32)
    out = {}
    for form in ("flat", "two-tier", "flat", "two-tier"):  # each twice: the second is timed
        link = SlowLinks(comm, NODES, latency, rate)
        wrapped = NodeCommunicator(link, NODES, form)
        comm.barrier()
        start = time.perf_counter()
        result = wrapped.all_reduce(x, group)
        seconds = time.perf_counter() - start
        everyone = MPI.COMM_WORLD.allgather((link.cross_node_bytes, seconds))
        out[form] = (result, sum(b for b, _ in everyone), max(s for _, s in everyone))
    same = np.array_equal(out["flat"][0], out["two-tier"][0])
    if comm.rank == 0:
        print(json.dumps({"same_bits": bool(same), "flat_bytes": out["flat"][1], "tiers_bytes": out["two-tier"][1],
                          "flat_s": out["flat"][2], "tiers_s": out["two-tier"][2]}), flush=True)
    comm.close()
    return 0 if same else 1


def step_times(tmp: str, form: str, rep: int, steps: int, link: str) -> list[float]:
    exe = os.path.join(os.path.dirname(sys.executable), "hspmd")
    cmd = [exe] if os.path.isfile(exe) else [sys.executable, "-m", "hspmd.cli.main"]
    log = os.path.join(tmp, f"{form}-{rep}.jsonl")
    env = {**os.environ, "HSPMD_SLOW_LINK": link, "HSPMD_NODE_COLLECTIVES": form}
    proc = subprocess.run([*cmd, "run", "-n", "4", *MODEL, "--steps", str(steps), "--strategy", "[0-3]: dp=4",
                           "--ranks-per-node", "2", "--log", log], cwd=ROOT, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"hspmd run ({form}) failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(log) if line.startswith("{")]
    return [r["time_s"] for r in rows if r["step"] > 2], [r["loss"] for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--link", default="50:0.117", help="latency_us:GB/s of the link between nodes")
    parser.add_argument("--mib", type=float, default=8.0, help="the all-reduce of part 1 (default 8 MiB)")
    parser.add_argument("--steps", type=int, default=8, help="steps of each run of part 2 (default 8)")
    parser.add_argument("--reps", type=int, default=2, help="runs of each form in part 2 (default 2)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    latency_us, rate = (float(v) for v in args.link.split(":"))
    if args.child:
        return child(args.mib, latency_us * 1e-6, rate * 1e9)
    from hspmd.runtime.launcher.launch import mpiexec_command

    cmd = mpiexec_command(4, [os.path.abspath(__file__), "--child", "--mib", str(args.mib), "--link", args.link])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the all-reduce part failed (or the bits differ):\n{proc.stdout}{proc.stderr[-3000:]}")
    part = json.loads(proc.stdout.strip().splitlines()[-1])
    g = NODES.count(0)
    print(f"{args.mib:g} MiB all-reduce, 4 ranks on 2 simulated nodes, link {latency_us:g} us {rate:g} GB/s: "
          f"same bits {part['same_bits']}; cross-node bytes two-tier {part['tiers_bytes'] / 2**20:.2f} MiB, flat "
          f"{part['flat_bytes'] / 2**20:.2f} MiB: {part['tiers_bytes'] / part['flat_bytes']:.3f} (target <= "
          f"{1 / g + 0.05:.2f}); time {part['tiers_s'] * 1e3:.1f} ms against {part['flat_s'] * 1e3:.1f} ms", flush=True)
    tmp = tempfile.mkdtemp(prefix="hier-allreduce-")
    times: dict[str, list[float]] = {"two-tier": [], "flat": []}
    losses = {}
    for rep in range(args.reps):
        for form in (("flat", "two-tier") if rep % 2 == 0 else ("two-tier", "flat")):
            t, losses[form] = step_times(tmp, form, rep, args.steps, args.link)
            times[form] += t
    tiers, flat = statistics.median(times["two-tier"]), statistics.median(times["flat"])
    print(f"GPT (2 layers of width 512) dp=4 on 2 simulated nodes: the same losses {losses['two-tier'] == losses['flat']}; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"step two-tier {tiers * 1e3:.1f} ms, flat {flat * 1e3:.1f} ms (median, {args.reps} runs each, alternating); "
          f"step time two-tier / flat: {tiers / flat:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
