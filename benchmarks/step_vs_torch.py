"""One training step of GPT-tiny: hspmd's plan against PyTorch eager, in the same process.

    python benchmarks/step_vs_torch.py [--steps 12] [--warmup 3] [--threads N] [--kernels cpu|numpy]
                                       [--no-torch-compile]

GPT-tiny: 4 layers, d_model 256, 4 heads, seq 128, batch 16, vocab 256, float32, AdamW with
weight decay and gradient clipping (examples/gpt.py), one process. PyTorch runs the same
model (`torch_loss`, started from hspmd's initial parameters, the same batch) with
torch.optim.AdamW and clip_grad_norm_. The two are timed alternately, step by step, so a
machine shared with other work slows both alike; the medians are compared. `--threads N`
gives both N threads (PyTorch's intra-op threads, NumPy's BLAS through threadpoolctl, the
plan's row threads); by default each uses what it finds (the CPUs of the machine). hspmd's
plan runs as `hspmd run` does by default (BLAS's threads); `--blas-threads auto` runs it with
`blas_threads="auto"` (HSPMD_BLAS_THREADS=auto): each step's matmuls on BLAS's threads or on
one, whichever its last steps measured faster (on a machine shared with other work, two BLAS
threads measured several times slower than one); BLAS's thread count is restored after each
step, so the NumPy reference products run on all threads.

A third column runs the same loss through `torch.compile` (inductor: generated C++ with
OpenMP on the CPU; the optimizer eager) unless `--no-torch-compile`; where it cannot compile
here (no C++ compiler, an inductor error) it is skipped with the reason printed.

Printed: the median step times; hspmd's matmul FLOP rate (the plan's matmul FLOPs per step /
its step time) against NumPy's own matmul rate on the largest matmul shape, also measured
alternately (on BLAS's threads and on one, the faster counts); each one's peak memory during training (resident-set growth, sampled every
millisecond in a fresh process, from before the parameters exist to the end of the steps)
and the plan's own count (`Plan.peak_bytes`); then hspmd / torch.compile, and last the
ratio hspmd / PyTorch eager of the median step times.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time

# as `import hspmd` sets it (hspmd/__init__.py), before NumPy's OpenBLAS loads: BLAS's threads
# sleep after each product instead of spinning for 0.1 s on a core that the next step needs
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "8")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two OpenMP runtimes share this process (PyTorch's own and the one hspmd's fused kernels link):
# threads of one that busy-wait after their work take the cores from the other's. Both sleep at
# once when idle (as hspmd's kernel loader sets for its own); PyTorch alone measured the same
# either way (355-425 ms active, 374-423 ms passive, same machine).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
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


def torch_loss(p: dict, ids, targets, heads: int, eps: float):
    """The loss of hspmd.frontend.transformer's GPT in plain PyTorch (head-major fused qkv)."""
    import torch

    F = torch.nn.functional
    b, t = ids.shape
    x = p["wte.weight"][ids] + p["wpe"][:t]
    layers = len({k.split(".")[1] for k in p if k.startswith("blocks.")})
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    for i in range(layers):
        q = f"blocks.{i}."
        h = F.layer_norm(x, x.shape[-1:], p[q + "ln1.weight"], p[q + "ln1.bias"], eps)
        qkv = h @ p[q + "attn.qkv.weight"] + p[q + "attn.qkv.bias"]
        d = x.shape[-1]
        hd = d // heads
        qq, kk, vv = (z.transpose(1, 2) for z in qkv.reshape(b, t, heads, 3 * hd).split(hd, dim=3))
        att = ((qq @ kk.transpose(-1, -2)) / math.sqrt(hd)).masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ vv).transpose(1, 2).reshape(b, t, d)
        x = x + y @ p[q + "attn.proj.weight"] + p[q + "attn.proj.bias"]
        h = F.layer_norm(x, x.shape[-1:], p[q + "ln2.weight"], p[q + "ln2.bias"], eps)
        h = F.gelu(h @ p[q + "mlp.fc.weight"] + p[q + "mlp.fc.bias"], approximate="tanh")
        x = x + h @ p[q + "mlp.proj.weight"] + p[q + "mlp.proj.bias"]
    x = F.layer_norm(x, x.shape[-1:], p["ln_f.weight"], p["ln_f.bias"], eps)
    return F.cross_entropy((x @ p["head.weight"]).reshape(b * t, -1), targets.reshape(-1))


class Torch:
    """PyTorch's side: the same parameters, AdamW and clipping as the script's optimizer.

    `compiled`: the loss (forward and backward) through `torch.compile` (inductor, the CPU's
    C++/OpenMP code); the optimizer step and the clipping stay eager, as in PyTorch's own
    recipe. The first step compiles (tens of seconds).
    """

    def __init__(self, script, params: dict[str, np.ndarray], compiled: bool = False) -> None:
        import torch

        from hspmd.runtime.stacked import per_layer

        params = per_layer(params)  # hspmd's stacked layers (`blocks.[0:4].ln1.weight`) one by one

        self.torch = torch
        self.loss_fn = torch.compile(torch_loss, dynamic=False) if compiled else torch_loss
        cfg, o = script.config, script.config["optim"]
        self.heads, self.eps = cfg["model"]["heads"], cfg["model"].get("eps", 1e-5)
        self.params = {k: torch.tensor(v, requires_grad=True) for k, v in params.items() if not k.startswith("opt.")}
        self.clip = o.get("clip") or 0.0
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=o["lr"], weight_decay=o["weight_decay"])

    def step(self, batch) -> float:
        torch = self.torch
        ids, targets = (torch.from_numpy(np.asarray(batch[k], dtype=np.int64)) for k in ("ids", "targets"))
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.params, ids, targets, self.heads, self.eps)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip)
        self.opt.step()
        return float(loss.detach())


def compiled_torch(script, params: dict[str, np.ndarray], batch) -> tuple["Torch | None", float, str]:
    """Return (the torch.compile runner, its first-step loss, "") after its first (compiling)
    step, or (None, nan, why) when it cannot compile here (no C++ compiler, an inductor error)."""
    try:
        runner = Torch(script, params, compiled=True)
        return runner, runner.step(batch), ""
    except Exception as err:  # inductor raises many kinds (BackendCompilerFailed, CalledProcessError, ...)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return None, math.nan, f"{type(err).__name__}: {first[:200]}"


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
            runners[name].step(batch)
            times[name].append(time.perf_counter() - start)
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


def memory_child(which: str, steps: int, threads: int | None, kernels: str, blas_threads: str) -> None:
    """Print the peak resident-set growth (bytes) of `steps` training steps of one framework."""
    script, compiled, fn = compile_tiny()
    batches = script.batches()
    batch_list = [next(batches) for _ in range(steps)]
    init = None
    if which == "torch":  # torch imported and hspmd's initial values made before the baseline
        import torch  # noqa: F401
        from hspmd.runtime.comm import InProcessCommunicator
        from hspmd.runtime.plan import build_plan

        init = build_plan(fn, 0, InProcessCommunicator.create_world(1)[0], allocate=False).initial_state(0)
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
        runner = Torch(script, init)  # copies the parameters
    for batch in batch_list:
        runner.step(batch)
    stop.set()
    sampler.join()
    print(max(peak[0], rss_bytes()) - base)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (default 3)")
    parser.add_argument("--threads", type=int, help="threads for both (default: each its own default)")
    parser.add_argument("--kernels", choices=["cpu", "numpy"], default="cpu",
                        help="hspmd's elementwise and row kernels: fused C++ (cpu, the default of hspmd run) or NumPy per op")
    parser.add_argument("--blas-threads", choices=["auto", "fixed"], default="fixed",
                        help="hspmd's matmuls always on BLAS's threads (fixed, hspmd run's default) or on BLAS's "
                             "threads or one, whichever measures faster (auto: HSPMD_BLAS_THREADS=auto)")
    parser.add_argument("--no-torch-compile", action="store_true",
                        help="leave out the torch.compile column (its first step compiles for tens of seconds)")
    parser.add_argument("--memory-child", choices=["hspmd", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    limit_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, 3, args.threads, args.kernels, args.blas_threads)
        return 0
    import torch

    from hspmd.codegen.schedule.analysis import matmul_flops

    script, compiled, fn = compile_tiny()
    ours = Hspmd(script, compiled, fn, args.threads, args.kernels, args.blas_threads)
    initial = {k: v.copy() for k, v in ours.state.items()}  # hspmd updates its state in place
    theirs = Torch(script, initial)
    flops = matmul_flops(fn)
    batches = script.batches()
    first = next(batches)
    l1, l2 = ours.step(first), theirs.step(first)
    inductor, why = None, "left out (--no-torch-compile)"
    if not args.no_torch_compile:
        inductor, l3, why = compiled_torch(script, initial, first)
    print(f"GPT-tiny, first step loss: hspmd {l1:.6f}, PyTorch {l2:.6f}"
          + (f", torch.compile {l3:.6f}" if inductor is not None else "")
          + f" (torch {torch.__version__}, {torch.get_num_threads()} threads; NumPy {np.__version__}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if inductor is None:
        print(f"torch.compile: skipped ({why})")
    runners = {"ours": ours, "torch": theirs, **({"inductor": inductor} if inductor is not None else {})}
    for _ in range(args.warmup - 1):
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
    print(f"median step: hspmd ({args.kernels} kernels{how}) {med_ours * 1e3:.1f} ms, PyTorch eager {med_torch * 1e3:.1f} ms"
          + (f", torch.compile {med['inductor'] * 1e3:.1f} ms" if "inductor" in med else "")
          + f" ({args.steps} steps each, alternating)")
    print(f"matmul FLOPs per step {flops / 1e9:.2f} G: hspmd {achieved / 1e9:.1f} GFLOP/s, NumPy matmul "
          f"({rows}x{d_model} @ {d_model}x{4 * d_model}, {mm_threads}) {numpy_rate / 1e9:.1f} GFLOP/s: ratio {achieved / numpy_rate:.3f}")
    mem = {}
    for which in ("hspmd", "torch"):
        extra = ((["--threads", str(args.threads)] if args.threads else []) + ["--kernels", args.kernels]
                 + ["--blas-threads", args.blas_threads])
        proc = subprocess.run([sys.executable, __file__, "--memory-child", which, *extra], capture_output=True,
                              text=True, timeout=1800)
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return 1
        mem[which] = int(proc.stdout.strip().splitlines()[-1])
    print(f"peak memory during training (RSS growth): hspmd {mem['hspmd'] / 2**20:.1f} MiB "
          f"(plan's own count {ours.plan.peak_bytes / 2**20:.1f} MiB), PyTorch {mem['torch'] / 2**20:.1f} MiB: "
          f"ratio {mem['hspmd'] / mem['torch']:.3f}")
    if "inductor" in med:
        print(f"step time hspmd / torch.compile (inductor): {med_ours / med['inductor']:.3f}")
    print(f"step time hspmd / PyTorch: {med_ours / med_torch:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
