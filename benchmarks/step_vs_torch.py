"""One training step of GPT-tiny: hspmd's plan against PyTorch eager, each as its users run it.

    python benchmarks/step_vs_torch.py [--steps 12] [--warmup 3] [--threads N] [--kernels cpu|numpy]
                                       [--no-torch-compile]

GPT-tiny: 4 layers, d_model 256, 4 heads, seq 128, batch 16, vocab 256, float32, AdamW with
weight decay and gradient clipping (examples/gpt.py). hspmd's plan runs in this process as
`hspmd run` runs it (its fused kernels set `OMP_WAIT_POLICY=passive` for themselves). PyTorch
runs the same model (`torch_peer.torch_loss`, from hspmd's initial parameters, the same batches)
with torch.optim.AdamW and clip_grad_norm_ in a process of its own, started with the environment
this benchmark was started with: PyTorch's defaults, as its users run it (`torch_peer.py`). A
second PyTorch eager process runs with `OMP_WAIT_POLICY=passive`, the setting this benchmark
used to impose on PyTorch by running it inside hspmd's process (17% slower there, issue 31): its
column shows what that cost. The runners are timed alternately, step by step, each step timed
inside its own process, so a machine shared with other work slows them alike; the medians are
compared. `--threads N` gives every runner N threads (PyTorch's intra-op threads, NumPy's BLAS
through threadpoolctl, the plan's row threads); by default each uses what it finds (the CPUs of
the machine). hspmd's plan runs as `hspmd run` does by default (BLAS's threads);
`--blas-threads auto` runs it with `blas_threads="auto"` (HSPMD_BLAS_THREADS=auto): each step's
matmuls on BLAS's threads or on one, whichever its last steps measured faster.

Another PyTorch process runs the same loss through `torch.compile` (inductor: generated C++ with
OpenMP on the CPU; the optimizer eager), with PyTorch's defaults, unless `--no-torch-compile`;
where it cannot compile here (no C++ compiler, an inductor error) it is skipped with the reason.

Printed: the median step times; hspmd's matmul FLOP rate (the plan's matmul FLOPs per step /
its step time) against NumPy's own matmul rate on the largest matmul shape, also measured
alternately (on BLAS's threads and on one, the faster counts); each one's peak memory during training (resident-set growth, sampled every
millisecond in a fresh process, from before the parameters exist to the end of the steps)
and the plan's own count (`Plan.peak_bytes`); then hspmd / torch.compile, hspmd / PyTorch eager
under OMP_WAIT_POLICY=passive, and last the ratio hspmd / PyTorch eager (its defaults) of the
median step times.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer  # noqa: E402  (first: it keeps the environment as this process found it, for the peers)

# as `import hspmd` sets it (hspmd/__init__.py), before NumPy's OpenBLAS loads: BLAS's threads
# sleep after each product instead of spinning for 0.1 s on a core that the next step needs
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "8")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY = {"model.layers": 4, "model.d_model": 256, "model.heads": 4, "model.seq_len": 128,
        "data.batch_size": 16, "model.vocab_size": 256, "model.dropout": 0.0, "precision": "float32"}


def compile_tiny():
    """Return (script, compiled, step function) of GPT-tiny on one device."""
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script
    from hspmd.dialects.levels import physical_groups

    script = load_script(os.path.join(ROOT, "examples", "gpt.py"), TINY)
    compiled = compile_script(script, "[0]: dp=1", 1)
    (_, module), = physical_groups(compiled.physical)
    fn = next(op for op in module.body.block.ops if getattr(op, "sym_name", None) is not None
              and op.sym_name.data == "train_step")
    return script, compiled, fn


class Hspmd:
    """hspmd's side: the plan, its state, and one step per call."""

    def __init__(self, script, compiled, fn, threads: int | None = None, kernels: str = "cpu",
                 blas_threads: str = "fixed") -> None:
        from hspmd.runtime.comm import InProcessCommunicator
        from hspmd.runtime.kernel_exec import select_program
        from hspmd.runtime.plan import build_plan

        (_, fused), = compiled.kernel_groups()  # the bundle's kernel level, as the compiler writes it
        module = select_program(fn.parent_op(), fused, kernels)  # as `hspmd run` does (default: fused CPU kernels)
        fn = next(op for op in module.body.block.ops if getattr(op, "sym_name", None) is not None
                  and op.sym_name.data == "train_step")
        self.plan = build_plan(fn, 0, InProcessCommunicator.create_world(1)[0], threads=threads,
                               blas_threads=blas_threads)
        self.state = self.plan.initial_state(int(script.config.get("seed", 0)))
        self.config = {**script.config, "lr_schedule": compiled.lr_schedule}
        self.names = {leaf.name for leaf in self.plan.inputs}
        self.n = 0

    def step(self, batch) -> float:
        from hspmd.runtime.worker import step_inputs

        self.n += 1
        inputs = self.plan.local_batch({**batch, **step_inputs(self.n, self.config, self.names)})
        return float(self.plan.run(self.state, inputs)["loss"])


def torch_settings(script) -> dict:
    """Return what the PyTorch peer needs of the script's config: heads, eps, AdamW's settings."""
    cfg, o = script.config, script.config["optim"]
    return {"heads": cfg["model"]["heads"], "eps": cfg["model"].get("eps", 1e-5), "lr": o["lr"],
            "weight_decay": o["weight_decay"], "clip": o.get("clip") or 0.0}


class PeerRunner:
    """A `torch_peer.Peer` as a runner of `alternate`: each call runs the next batch there."""

    def __init__(self, peer: "torch_peer.Peer") -> None:
        self.peer, self.i = peer, 0
        self.times: list[float] = []

    def step(self, batch=None) -> float:
        self.i += 1
        return self.peer.step(self.i)


def alternate(runners: dict, batches, steps: int, between) -> dict[str, list[float]]:
    """Return each runner's step times over `steps` batches, the runners taking turns step by
    step (each goes first in turn, so a machine shared with other work slows all alike);
    `between()` runs after every round."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for i in range(steps):
        batch = next(batches)
        for name in order[i % len(order):] + order[:i % len(order)]:
            start = time.perf_counter()
            inside = runners[name].step(batch)
            # a peer in its own process says how long its step took there
            times[name].append(inside if isinstance(runners[name], PeerRunner) else time.perf_counter() - start)
        between()
    return times


def numpy_matmul_seconds(m: int, k: int, n: int, threads: int | None = None) -> float:
    """Return the time of one float32 (m x k) @ (k x n) with NumPy (median of 5), on BLAS's
    threads or on `threads`."""
    if threads is not None:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(threads, user_api="blas"):
            return numpy_matmul_seconds(m, k, n)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    out = np.empty((m, n), np.float32)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.matmul(a, b, out=out)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def limit_threads(n: int | None) -> None:
    """Give PyTorch and NumPy's BLAS `n` threads (nothing when None)."""
    if n is None:
        return
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(n, user_api="blas")


def memory_child(which: str, steps: int, threads: int | None, kernels: str, blas_threads: str, data: str) -> None:
    """Print the peak resident-set growth (bytes) of `steps` training steps of one framework (PyTorch:
    from the peer's inputs in `data`, in a process with the environment the benchmark found)."""
    if which == "torch":  # torch imported and the parameters read before the baseline; no hspmd here
        import torch  # noqa: F401

        settings, init, batch_list = torch_peer.read_inputs(data)
        batch_list = batch_list[:steps]
    else:
        script, compiled, fn = compile_tiny()
        batches = script.batches()
        batch_list = [next(batches) for _ in range(steps)]
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.001)

    base = rss_bytes()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if which == "hspmd":
        runner = Hspmd(script, compiled, fn, threads, kernels, blas_threads)
    else:
        runner = torch_peer.Torch(settings, init)  # copies the parameters
    for batch in batch_list:
        runner.step(batch)
    stop.set()
    sampler.join()
    print(max(peak[0], rss_bytes()) - base)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (default 3)")
    parser.add_argument("--threads", type=int, help="threads for every runner (default: each its own default)")
    parser.add_argument("--kernels", choices=["cpu", "numpy"], default="cpu",
                        help="hspmd's elementwise and row kernels: fused C++ (cpu, the default of hspmd run) or NumPy per op")
    parser.add_argument("--blas-threads", choices=["auto", "fixed"], default="fixed",
                        help="hspmd's matmuls always on BLAS's threads (fixed, hspmd run's default) or on BLAS's "
                             "threads or one, whichever measures faster (auto: HSPMD_BLAS_THREADS=auto)")
    parser.add_argument("--no-torch-compile", action="store_true",
                        help="leave out the torch.compile column (its first step compiles for tens of seconds)")
    parser.add_argument("--memory-child", choices=["hspmd", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is not None:  # the peers read it from their environment
        torch_peer.START_ENV.update(OMP_NUM_THREADS=str(args.threads))
    if args.memory_child:
        if args.memory_child == "torch":
            limit_threads(args.threads)
        elif args.threads is not None:
            from threadpoolctl import threadpool_limits

            threadpool_limits(args.threads, user_api="blas")
        memory_child(args.memory_child, 3, args.threads, args.kernels, args.blas_threads, args.data)
        return 0
    if args.threads is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads, user_api="blas")
    from hspmd.codegen.schedule.analysis import matmul_flops
    from hspmd.runtime.stacked import per_layer

    script, compiled, fn = compile_tiny()
    ours = Hspmd(script, compiled, fn, args.threads, args.kernels, args.blas_threads)
    batches = script.batches()
    batch_list = [next(batches) for _ in range(1 + args.warmup + args.steps)]
    with tempfile.TemporaryDirectory(prefix="step-vs-torch-") as data:
        # hspmd's initial parameters, one tensor per layer (hspmd updates its state in place)
        torch_peer.write_inputs(data, torch_settings(script), per_layer({k: v.copy() for k, v in ours.state.items()}),
                                batch_list)
        peers = {"torch": torch_peer.Peer(data), "torch-passive": torch_peer.Peer(data, env="passive")}
        why = "left out (--no-torch-compile)"
        if not args.no_torch_compile:
            try:
                peers["inductor"] = torch_peer.Peer(data, compiled=True)
            except RuntimeError as err:
                why = str(err)
        try:
            return _measure(args, script, ours, fn, peers, batch_list, why, data, matmul_flops)
        finally:
            for peer in peers.values():
                peer.close()


def _measure(args, script, ours, fn, peers, batch_list, why, data, matmul_flops) -> int:
    """Time the runners alternately and print the results (see the module docstring)."""
    flops = matmul_flops(fn)
    l1 = ours.step(batch_list[0])
    torch = peers["torch"]
    print(f"GPT-tiny, first step loss: hspmd {l1:.6f}, PyTorch {torch.first_loss:.6f}"
          + (f", torch.compile {peers['inductor'].first_loss:.6f}" if "inductor" in peers else "")
          + f" (torch {torch.version}, {torch.threads} threads, its own process with its defaults; NumPy "
          f"{np.__version__}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if "inductor" not in peers:
        print(f"torch.compile: skipped ({why})")
    runners = {"ours": ours, **{name: PeerRunner(p) for name, p in peers.items()}}
    batches = iter(batch_list[1:])
    for _ in range(args.warmup):
        batch = next(batches)
        for runner in runners.values():
            runner.step(batch)
    t_mm: list[float] = []
    t_mm1: list[float] = []
    d_model, seq = script.config["model"]["d_model"], script.config["model"]["seq_len"]
    rows = script.config["data"]["batch_size"] * seq

    def numpy_products() -> None:
        t_mm.append(numpy_matmul_seconds(rows, d_model, 4 * d_model))
        t_mm1.append(numpy_matmul_seconds(rows, d_model, 4 * d_model, threads=1))

    times = alternate(runners, batches, args.steps, numpy_products)
    med = {name: float(np.median(t)) for name, t in times.items()}
    # NumPy's rate: the faster of BLAS's threads and one thread (as hspmd's "auto" may pick either)
    mm_threads = "BLAS's threads" if np.median(t_mm) <= np.median(t_mm1) else "one thread"
    med_ours, med_torch, med_mm = med["ours"], med["torch"], min(float(np.median(t_mm)), float(np.median(t_mm1)))
    numpy_rate = 2 * rows * d_model * 4 * d_model / med_mm
    achieved = flops / med_ours
    blas = ours.plan.blas
    how = (f", BLAS threads auto: {', '.join(f'{n} on {k}' for n, k in blas.steps.items())} of "
           f"{sum(blas.steps.values())} steps" if blas is not None else "")
    print(f"median step: hspmd ({args.kernels} kernels{how}) {med_ours * 1e3:.1f} ms, PyTorch eager {med_torch * 1e3:.1f} ms "
          f"(its defaults), PyTorch eager under OMP_WAIT_POLICY=passive {med['torch-passive'] * 1e3:.1f} ms"
          + (f", torch.compile {med['inductor'] * 1e3:.1f} ms" if "inductor" in med else "")
          + f" ({args.steps} steps each, alternating)")
    print(f"matmul FLOPs per step {flops / 1e9:.2f} G: hspmd {achieved / 1e9:.1f} GFLOP/s, NumPy matmul "
          f"({rows}x{d_model} @ {d_model}x{4 * d_model}, {mm_threads}) {numpy_rate / 1e9:.1f} GFLOP/s: ratio {achieved / numpy_rate:.3f}")
    mem = {}
    for which in ("hspmd", "torch"):
        extra = ((["--threads", str(args.threads)] if args.threads else []) + ["--kernels", args.kernels]
                 + ["--blas-threads", args.blas_threads, "--data", data])
        proc = subprocess.run([sys.executable, __file__, "--memory-child", which, *extra], capture_output=True,
                              text=True, timeout=1800, env=torch_peer.START_ENV if which == "torch" else None)
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return 1
        mem[which] = int(proc.stdout.strip().splitlines()[-1])
    print(f"peak memory during training (RSS growth): hspmd {mem['hspmd'] / 2**20:.1f} MiB "
          f"(plan's own count {ours.plan.peak_bytes / 2**20:.1f} MiB), PyTorch {mem['torch'] / 2**20:.1f} MiB: "
          f"ratio {mem['hspmd'] / mem['torch']:.3f}")
    if "inductor" in med:
        print(f"step time hspmd / torch.compile (inductor): {med_ours / med['inductor']:.3f}")
    print(f"step time hspmd / PyTorch eager under OMP_WAIT_POLICY=passive (the old, handicapped peer): "
          f"{med_ours / med['torch-passive']:.3f}")
    print(f"step time hspmd / PyTorch (its own process, its defaults): {med_ours / med_torch:.3f}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
