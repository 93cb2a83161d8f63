"""Sharded checkpoints: write and read bandwidth per rank against plain safetensors, and the
step stall of a background checkpoint.

    python benchmarks/checkpoint_io.py [--ranks 2] [--reps 5] [--blocks 6] [--block-steps 4]

1. **Bandwidth per rank** (started under the mpich wheel's mpiexec on `--ranks` ranks, GPT-tiny
   as in `step_vs_torch.py` compiled for `[0..R-1]: dp=R`, every parameter and AdamW state).
   Each rank times, alternately and after a barrier each:
   * ours, write: `CheckpointWriter.save` + `wait` of step k: the rank's owned pieces copied,
     written to `step-k.tmp/rank-r.safetensors` with fsync, its index, and on rank 0 the
     manifest and the rename;
   * plain, write: `safetensors.numpy.save_file` of the same pieces (the same bytes) to a file
     of the rank's own, then fsync;
   * ours, read: `load_state` of that checkpoint under the same layouts: every piece's CRC-32
     checked once across the ranks, then the rank's whole state read slice by slice, and the
     ranks' agreement (one all-reduce);
   * plain, read: `safetensors.numpy.load_file` of one file holding the rank's whole state
     (the bytes ours reads), written once before.
   A step's time is the slower rank's; the medians are compared. Reads come from the page
   cache (the files were just written; dropping it needs privileges a benchmark should not).
2. **Stall** (in this process, one device, the fused CPU kernels `hspmd run` uses): blocks of
   `--block-steps` training steps, timed alternately without a checkpoint and with one
   (`save` after the block's first step, the write running in the background through the
   rest, and `wait` at the block's end, inside the timing). The stall of one checkpoint is the
   difference of the two medians, the slowdown that the background thread causes included;
   the training thread's own time in `save` (the copy) is printed beside it.

The stall is measured twice: first with training on all but one core (the write has a core of
its own, as it has beside a GPU, where the CPU mostly waits), then with training on every core
(the write must take CPU time from the step: on 2 cores it costs roughly its own CPU time,
~45 ms for GPT-tiny's 40 MB, and more when it preempts one of two OpenMP threads).

The last line ends with the headline ratio: the stall of one checkpoint ÷ one step's time,
training on every core (the issue's target: ≤ 0.10).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_vs_torch import TINY, Hspmd, compile_tiny  # noqa: E402


def _rank_plan(ranks: int, comm):
    """Return (script, plan, state) of GPT-tiny under `[0..R-1]: dp=R` as this MPI rank."""
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script
    from hspmd.runtime.plan import build_plan

    script = load_script(os.path.join(ROOT, "examples", "gpt.py"), TINY)
    strategy = f"[0-{ranks - 1}]: dp={ranks}" if ranks > 1 else "[0]: dp=1"
    compiled = compile_script(script, strategy, ranks)
    module = next(m for devices, m in compiled.kernel_groups() if comm.rank in devices)
    fn = next(op for op in module.body.block.ops if getattr(op, "sym_name", None) is not None
              and op.sym_name.data == "train_step")
    plan = build_plan(fn, comm.rank, comm)
    return script, strategy, plan, plan.initial_state(int(script.config.get("seed", 0)))


def io_child(ranks: int, reps: int, directory: str) -> int:
    """One rank of the bandwidth measurement (under mpiexec)."""
    from mpi4py import MPI
    from safetensors.numpy import load_file, save_file

    from hspmd.runtime.checkpoint.manifest import piece_key, read_manifest
    from hspmd.runtime.checkpoint.reader import load_state
    from hspmd.runtime.checkpoint.writer import CheckpointWriter, RunInfo, fsync_path
    from hspmd.runtime.comm.mpi import MPICommunicator

    comm = MPICommunicator()
    world = MPI.COMM_WORLD
    script, strategy, plan, state = _rank_plan(ranks, comm)
    ck = os.path.join(directory, "ck")
    writer = CheckpointWriter(ck, comm.rank, comm.size, plan.params,
                              RunInfo(strategy, ranks, "examples/gpt.py", script.config, 0), keep=2, comm=comm)
    owned = {piece_key(leaf.name, region): np.ascontiguousarray(state[leaf.name]) for leaf, region in writer.pieces}
    written = sum(a.nbytes for a in owned.values())
    held = {leaf.name: np.ascontiguousarray(state[leaf.name]) for leaf in plan.params}
    read = sum(a.nbytes for a in held.values())
    plain_w = os.path.join(directory, f"plain-write-{comm.rank}.safetensors")
    plain_r = os.path.join(directory, f"plain-read-{comm.rank}.safetensors")
    save_file(held, plain_r)

    step = [0]

    def ours_write() -> None:
        step[0] += 1
        writer.save(step[0], state, step[0], None)
        writer.wait()

    def plain_write() -> None:
        save_file(owned, plain_w)
        fsync_path(plain_w)

    def ours_read() -> dict[str, np.ndarray]:
        where = os.path.join(ck, f"step-{step[0]}")
        world.Barrier()  # rank 0 renames the directory in its `wait`: every rank sees it after this
        return load_state(where, read_manifest(where), plan.params, comm.rank, comm)

    def plain_read() -> None:
        load_file(plain_r)

    ours_write()
    loaded = ours_read()
    assert all(loaded[k].tobytes() == v.tobytes() for k, v in held.items()), "the checkpoint reads back otherwise"
    cases = [("ours write", ours_write), ("plain write", plain_write), ("ours read", ours_read),
             ("plain read", plain_read)]
    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for i in range(reps + 1):
        order = cases[:2][:: 1 if i % 2 else -1] + cases[2:][:: 1 if i % 2 else -1]
        if order[0][0] == "plain write":  # a read needs the checkpoint this round wrote
            order = [order[1], order[0], *order[2:]]
        for name, fn in order:
            world.Barrier()
            start = time.perf_counter()
            fn()
            if i:  # the first round warms the files and the page cache
                times[name].append(time.perf_counter() - start)
    med = {}
    for name, ts in times.items():
        slowest = np.empty(len(ts))
        world.Allreduce(np.array(ts), slowest, op=MPI.MAX)
        med[name] = float(np.median(slowest))
    if comm.rank == 0:
        mib = lambda b, s: b / 2**20 / s  # noqa: E731
        print(f"{ranks} ranks, {strategy}: each rank writes {written / 2**20:.1f} MiB (its share of "
              f"{len(plan.params)} tensors) and reads {read / 2**20:.1f} MiB, median of {reps} (slower rank)")
        print(f"write: ours {med['ours write'] * 1e3:.1f} ms ({mib(written, med['ours write']):.0f} MiB/s per rank), "
              f"plain safetensors {med['plain write'] * 1e3:.1f} ms ({mib(written, med['plain write']):.0f} MiB/s); "
              f"bandwidth ours / plain {med['plain write'] / med['ours write']:.3f}")
        print(f"read:  ours {med['ours read'] * 1e3:.1f} ms ({mib(read, med['ours read']):.0f} MiB/s per rank, "
              f"checksums included), plain safetensors {med['plain read'] * 1e3:.1f} ms "
              f"({mib(read, med['plain read']):.0f} MiB/s); bandwidth ours / plain "
              f"{med['plain read'] / med['ours read']:.3f}", flush=True)
    writer.close()
    comm.close()
    return 0


def stall(blocks: int, block_steps: int, directory: str, threads: int | None = None) -> tuple[float, float, float]:
    """Return (median step s, stall of one checkpoint s, median time in `save` s) on one device,
    training with `threads` BLAS and row threads (None: what it finds)."""
    from threadpoolctl import threadpool_limits

    if threads is None:
        return _stall(blocks, block_steps, directory, None)
    with threadpool_limits(threads, user_api="blas"):  # undone on return
        return _stall(blocks, block_steps, directory, threads)


def _stall(blocks: int, block_steps: int, directory: str, threads: int | None) -> tuple[float, float, float]:
    from hspmd.runtime.checkpoint.writer import CheckpointWriter, RunInfo

    script, compiled, fn = compile_tiny()
    runner = Hspmd(script, compiled, fn, threads=threads)
    batches = script.batches()
    writer = CheckpointWriter(os.path.join(directory, "stall"), 0, 1, runner.plan.params,
                              RunInfo("[0]: dp=1", 1, "examples/gpt.py", script.config, 0), keep=1)
    for _ in range(3):  # warm-up
        runner.step(next(batches))

    def block(checkpoint: bool) -> float:
        start = time.perf_counter()
        for i in range(block_steps):
            runner.step(next(batches))
            if checkpoint and i == 0:
                writer.save(runner.n, runner.state, runner.n, None)
        writer.wait()
        return time.perf_counter() - start

    plain, with_ck = [], []
    for i in range(blocks):
        for checkpoint in ((False, True) if i % 2 else (True, False)):
            (with_ck if checkpoint else plain).append(block(checkpoint))
    writer.close()
    step = float(np.median(plain)) / block_steps
    copy = float(np.median(writer.stall_s))
    # the difference holds the copy; where the blocks' noise hides it, the copy is the floor
    return step, max(float(np.median(with_ck) - np.median(plain)), copy), copy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the bandwidth measurement (default 2)")
    parser.add_argument("--reps", type=int, default=5, help="timed writes and reads of each (default 5)")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks with and without a checkpoint (default 6)")
    parser.add_argument("--block-steps", type=int, default=4, help="steps per block (default 4)")
    parser.add_argument("--io-child", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.io_child:
        return io_child(args.ranks, args.reps, args.io_child)
    from hspmd.runtime.launcher.launch import mpiexec_command, rank_environment

    directory = tempfile.mkdtemp(prefix="hspmd-ckbench-")
    try:
        cmd = mpiexec_command(args.ranks, [os.path.abspath(__file__), "--io-child", directory,
                                           "--ranks", str(args.ranks), "--reps", str(args.reps)])
        code = subprocess.run(cmd, env=rank_environment(args.ranks), timeout=1800).returncode
        if code:
            return code
        cores = len(os.sched_getaffinity(0))
        if cores > 1:  # training on all but one core: the write has a core of its own, as beside a GPU
            step, stalled, copy = stall(args.blocks, args.block_steps, directory, threads=cores - 1)
            print(f"with {cores - 1} of {cores} cores training (one left to the write): step {step * 1e3:.1f} ms, "
                  f"a checkpoint adds {stalled * 1e3:.1f} ms; stall / step {stalled / step:.3f}", flush=True)
        step, stalled, copy = stall(args.blocks, args.block_steps, directory)
        print(f"GPT-tiny step {step * 1e3:.1f} ms (median, fused CPU kernels); one background checkpoint adds "
              f"{stalled * 1e3:.1f} ms to a block of {args.block_steps} steps (the training thread's copy in "
              f"save: {copy * 1e3:.1f} ms); stall / step {stalled / step:.3f}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
