"""Hot switching between strategies against checkpoint-and-restart, and its bytes against the minimum.

    python benchmarks/switch.py [--layers 4] [--reps 5]

GPT (examples/gpt.py, `--layers` layers, d_model 128) compiled once for `[0,1]: dp=2`,
`[0,1]: tp=2` and `[0,1]: pp=2` (one bundle), on 2 ranks in this process (threads, the
in-process communicator). For each ordered pair A -> B that moves data, every rank holding
A's state (parameters and AdamW states after one step):

* **hot switch**: `Switcher.switch` (the plan cached after the first switch, as in a run): every
  piece a rank lacks sent in one message per pair of ranks, the rest kept or copied in memory;
* **checkpoint and restart into B**: what a run that stops and starts again under B does, short
  of starting processes and importing Python (left out, in restart's favour): write A's sharded
  checkpoint (`CheckpointWriter`, fsync), then parse B's program, build its plan, and read the
  checkpoint back under B's layouts (`load_state`, checksums verified).

Times are the median of `--reps` of each, alternated, of the slower rank. Bytes: the plan's bytes
against the minimum, counted by brute force over every element (for each rank, the elements of
its pieces under B that it did not hold under A, from NumPy masks of each tensor).

The last line ends with the headline ratio: the worst pair's hot switch ÷ checkpoint-and-restart
(target ≤ 0.1); the line before it the worst bytes moved ÷ minimum (target ≤ 1.1). Each pair's
line also gives the checkpoint's write and read alone (restart without parsing and planning B).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hspmd.codegen.bundle import read_manifest  # noqa: E402
from hspmd.compiler import compile_strategies, write_bundle  # noqa: E402
from hspmd.frontend.script import load_script, parse_overrides  # noqa: E402
from hspmd.runtime.checkpoint.manifest import read_manifest as read_checkpoint, resolve_checkpoint  # noqa: E402
from hspmd.runtime.checkpoint.reader import load_state  # noqa: E402
from hspmd.runtime.checkpoint.writer import CheckpointWriter, RunInfo  # noqa: E402
from hspmd.runtime.comm.inprocess import run_spmd  # noqa: E402
from hspmd.runtime.switch import bundle_holdings  # noqa: E402
from hspmd.runtime.worker import load_batches, load_rank_program, split_microbatches, step_inputs  # noqa: E402
from hspmd.runtime.worker import switching_programs  # noqa: E402

STRATEGIES = ["[0,1]: dp=2", "[0,1]: tp=2", "[0,1]: pp=2"]


def minimum_bytes(before, after) -> int:
    """Return the bytes every rank lacks going from holdings `before` to `after`, by brute force."""
    total = 0
    for rank, leaves in after.items():
        for name, leaf in leaves.items():
            need = np.zeros(leaf.global_shape, bool)
            need[leaf.layout.slices(rank, leaf.global_shape)] = True
            if name in before.get(rank, {}):
                old = before[rank][name]
                need[old.layout.slices(rank, old.global_shape)] = False
            total += int(need.sum()) * np.dtype(leaf.dtype).itemsize
    return total


def measure(bundle: str, reps: int, scratch: str):
    """Return, per ordered pair, the ranks' (switch seconds, restart seconds) lists and the plan's bytes."""
    manifest = read_manifest(bundle)
    subs = [".", *manifest.variants]
    pairs = [(a, b) for a in range(3) for b in range(3) if a != b]

    def rank(comm):
        first = load_rank_program(bundle, manifest, comm, "cpu", True)
        programs, switcher = switching_programs(bundle, manifest, first, comm, "cpu", None)
        batch = next(load_batches(manifest.script, manifest.config))
        out = {}
        for a, b in pairs:
            state = programs[a].plan.initial_state(0)  # A's state after one step
            plan = programs[a].plan
            names = {leaf.name: leaf.global_shape for leaf in plan.inputs}
            inputs = split_microbatches({**batch, **step_inputs(1, manifest.config, names)}, names)
            plan.run(state, plan.local_batch(inputs))
            switcher.plan(a, b)  # planned once per pair, before the run's first switch
            hot, restart = [], []
            for rep in range(reps):
                comm.barrier()
                start = time.perf_counter()
                switcher.switch(state, a, b)
                hot.append(time.perf_counter() - start)
                comm.barrier()
                restart.append(_restart(bundle, subs, a, b, state, programs[a].plan.params, comm, manifest,
                                        scratch, rep))
            out[a, b] = (hot, restart, switcher.plan(a, b).bytes_moved())
        return out

    return run_spmd(2, rank, timeout=3600)


def _restart(bundle, subs, a, b, state, leaves, comm, manifest, scratch, rep) -> tuple[float, float]:
    """Return the seconds to checkpoint `state` (under A) and start B from it (plan and load), and
    of them the checkpoint's write and read alone."""
    directory = os.path.join(scratch, f"{a}-{b}-{rep}")
    start = time.perf_counter()
    writer = CheckpointWriter(directory, comm.rank, comm.size, leaves,
                              RunInfo(STRATEGIES[a], 2, manifest.script, manifest.config, 0), None, comm)
    writer.save(1, state, 1, None)
    writer.close()
    comm.barrier()
    written = time.perf_counter()
    where = os.path.join(bundle, subs[b])
    program = load_rank_program(where, read_manifest(where), comm, "cpu", True)
    planned = time.perf_counter()
    found = resolve_checkpoint(directory)
    load_state(found, read_checkpoint(found), program.plan.params, comm.rank, comm)
    comm.barrier()
    end = time.perf_counter()
    return end - start, (written - start) + (end - planned)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="GPT layers (default 4)")
    parser.add_argument("--reps", type=int, default=5, help="timed switches and restarts per pair (default 5)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    script = load_script(os.path.join(ROOT, "examples", "gpt.py"), parse_overrides([f"model.layers={args.layers}"]))
    bundle = write_bundle(compile_strategies(script, STRATEGIES, 2), tempfile.mkdtemp(prefix="hspmd-switch-"))
    manifest = read_manifest(bundle)
    holdings = [bundle_holdings(os.path.join(bundle, s)) for s in [".", *manifest.variants]]
    scratch = tempfile.mkdtemp(prefix="hspmd-switchbench-")
    try:
        results = measure(bundle, args.reps, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    worst_time, worst_bytes = 0.0, 0.0
    for (a, b), (_, _, moved) in results[0].items():
        hot = statistics.median(max(r[a, b][0][i] for r in results) for i in range(args.reps))
        restart = statistics.median(max(r[a, b][1][i][0] for r in results) for i in range(args.reps))
        io = statistics.median(max(r[a, b][1][i][1] for r in results) for i in range(args.reps))
        least = minimum_bytes(holdings[a], holdings[b])
        ratio = moved / least if least else 1.0
        print(f"{STRATEGIES[a]:>12} -> {STRATEGIES[b]:<12} hot switch {hot * 1e3:7.1f} ms, checkpoint and restart "
              f"{restart * 1e3:7.1f} ms ({hot / restart:.3f}; its write and read alone {io * 1e3:.1f} ms); moved {moved / 2**20:.2f} MiB, minimum "
              f"{least / 2**20:.2f} MiB ({ratio:.3f})", flush=True)
        worst_time, worst_bytes = max(worst_time, hot / restart), max(worst_bytes, ratio)
    print(f"worst pair: bytes moved / minimum {worst_bytes:.3f}")
    print(f"worst pair: hot switch / checkpoint-and-restart {worst_time:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
