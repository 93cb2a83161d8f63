"""Memory at scale: hspmd's `zero=3 recompute=block` against PyTorch FSDP2 with activation checkpointing.

    python benchmarks/memory_vs_fsdp.py [--layers 12] [--d-model 768] [--heads 12] [--seq 256]
                                        [--batch 8] [--ranks 4] [--steps 3]

GPT at the GPT-2-small shape (12 layers, d_model 768, 12 heads, sequence 256, byte-level
vocabulary of 256, examples/gpt.py: AdamW with clipping), global batch 8, on 4 CPU ranks:

* hspmd: `[0-3]: dp=4 zero=3 recompute=block` (and, for the recompute ratios, `[0-3]: dp=4 zero=3`),
  each run as `hspmd run -n 4` runs it (`hspmd.runtime.launcher.launch`: mpiexec, its thread shares; each
  rank the loop of `worker.train`, without the gathering of the whole parameters onto rank 0 that
  `train` does after the last step to return them);
* PyTorch: the same model as an `nn.Module` of blocks, built on the meta device (FSDP2's way for
  a large model: no rank ever holds it whole), each block wrapped in `checkpoint_wrapper` and
  `fully_shard`ed (FSDP2), then the root, then materialised shard by shard (`to_empty`,
  `reset_parameters`); gloo; AdamW and `clip_grad_norm_`; 4 processes of their own started with
  the environment this benchmark was started with (PyTorch's defaults).

Each rank measures its own peak resident memory: its resident set, sampled every millisecond by a
thread, from just before its model exists (after imports and, for PyTorch, the process group) to
the end of its steps (the growth; also printed: `ru_maxrss`, the whole process's peak with its
libraries), and its step times (the median of the steps after the first; the slowest rank's).
Printed: each side's numbers, then the ratios the issue asks for:

* peak memory per rank, hspmd / FSDP2 + checkpointing (target <= 0.8; the last line);
* step time, same pair (<= 1.0);
* activations kept for the backward with `recompute=block` / without (planned, <= 1 / (layers / 2));
* step time with `recompute=block` / without (<= 1.4);
* planned peak (`hspmd compile --report`'s) / measured peak (within 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: the environment as this process found it: PyTorch's processes get exactly this
START_ENV = dict(os.environ)


# ----------------------------------------------------------------------------- measuring


class RssSampler:
    """Samples this process's resident set every millisecond; `peak - base` is the growth."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.now()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def stop(self) -> dict:
        import resource

        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
        return {"growth": self.peak - self.base, "base": self.base,
                "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _write(out: str, rank: int, record: dict) -> None:
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)


def _gather(out: str, ranks: int) -> list[dict]:
    records = []
    for r in range(ranks):
        with open(os.path.join(out, f"rank-{r}.json")) as f:
            records.append(json.load(f))
    return records


# ----------------------------------------------------------------------------- hspmd's side


def hspmd_child(bundle: str, out: str, steps: int) -> int:
    """One rank of hspmd's run (under mpiexec): the loop of `worker.train` (its program loaded and
    planned, its parameters made, `steps` steps on the script's batches), without what `train`
    does after the steps (gathering the whole parameters on rank 0 to return them); write its numbers."""
    from hspmd.codegen.bundle import read_manifest
    from hspmd.runtime.comm.mpi import MPICommunicator
    from hspmd.runtime.worker import load_batches, load_rank_program, split_microbatches, step_inputs

    comm = MPICommunicator()
    manifest = read_manifest(bundle)
    config = manifest.config
    batches = load_batches(manifest.script, config)
    sampler = RssSampler()
    plan = load_rank_program(bundle, manifest, comm, "cpu", True).plan
    state = plan.initial_state(int(config.get("seed", 0)))
    names = {leaf.name: leaf.global_shape for leaf in plan.inputs}
    times, losses, marks = [], [], {"planned": sampler.now() - sampler.base}
    for step in range(1, steps + 1):
        batch = split_microbatches({**next(batches), **step_inputs(step, config, names)}, names)
        start = time.perf_counter()
        outputs = plan.run(state, plan.local_batch(batch))
        times.append(time.perf_counter() - start)
        losses.append(float(outputs["loss"]))
        marks[f"step {step}"] = sampler.now() - sampler.base
    memory = sampler.stop()
    _write(out, comm.rank, {**memory, "step_s": times, "losses": losses, "marks": marks})
    return 0


def run_hspmd(script, strategy: str, ranks: int, steps: int, work: str) -> dict:
    """Compile and run `strategy`; return measured and planned numbers."""
    from hspmd.codegen.schedule.analysis import memory_rows
    from hspmd.compiler import compile_script, write_bundle
    from hspmd.runtime.launcher.launch import launch

    compiled = compile_script(script, strategy, ranks)
    planned = memory_rows(compiled.physical)
    bundle = tempfile.mkdtemp(dir=work, prefix="bundle-")
    write_bundle(compiled, bundle)
    out = tempfile.mkdtemp(dir=work, prefix="out-")
    code = launch(ranks, [os.path.abspath(__file__), "--child-hspmd", bundle, "--out", out, "--steps", str(steps)],
                  timeout=900)
    if code != 0:
        raise SystemExit(f"hspmd's run of '{strategy}' failed (exit {code})")
    return {"ranks": _gather(out, ranks), "planned_peak": max(r.peak for r in planned),
            "activations": max(r.activations or 0 for r in planned)}


# ----------------------------------------------------------------------------- PyTorch's side


def torch_child(rank: int, world: int, directory: str, out: str, steps: int) -> int:
    """One rank of PyTorch FSDP2 (fully_shard per block and root, checkpoint_wrapper per block)."""
    import math

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    F = torch.nn.functional
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with open(os.path.join(directory, "settings.json")) as f:
        s = json.load(f)
    data = np.load(os.path.join(directory, "batches.npz"))

    class Block(torch.nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            hd = d // self.heads
            q, k, v = (z.transpose(1, 2) for z in self.qkv(self.ln1(x)).reshape(b, t, self.heads, 3 * hd).split(hd, 3))
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
            att = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).masked_fill(mask, float("-inf")).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = s["d_model"]
            self.wte = torch.nn.Embedding(s["vocab"], d)
            self.wpe = torch.nn.Parameter(torch.zeros(s["seq"], d))
            self.blocks = torch.nn.ModuleList(Block(d, s["heads"]) for _ in range(s["layers"]))
            self.ln_f = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, s["vocab"], bias=False)

        def forward(self, ids, targets):
            x = self.wte(ids) + self.wpe[: ids.shape[1]]
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    sampler = RssSampler()
    torch.manual_seed(0)
    with torch.device("meta"):  # FSDP2's way for a large model: built without memory, sharded, then made
        model = GPT()
    for i, block in enumerate(model.blocks):
        wrapped = checkpoint_wrapper(block)
        fully_shard(wrapped)
        model.blocks[i] = wrapped
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        model.wpe.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=s["weight_decay"])
    rows = s["batch"] // world
    times, losses = [], []
    for step in range(steps):
        ids = torch.from_numpy(data["ids"][step % len(data["ids"])][rank * rows:(rank + 1) * rows])
        targets = torch.from_numpy(data["targets"][step % len(data["targets"])][rank * rows:(rank + 1) * rows])
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip"])
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    memory = sampler.stop()
    _write(out, rank, {**memory, "step_s": times, "losses": losses})
    dist.destroy_process_group()
    return 0


def run_torch(settings: dict, batches: list[dict], ranks: int, steps: int, work: str) -> dict:
    """Run PyTorch FSDP2 in `ranks` processes of its own; return its measured numbers."""
    import socket

    import numpy as np

    directory = tempfile.mkdtemp(dir=work, prefix="torch-")
    with open(os.path.join(directory, "settings.json"), "w") as f:
        json.dump(settings, f)
    np.savez(os.path.join(directory, "batches.npz"), ids=np.stack([b["ids"] for b in batches]).astype(np.int64),
             targets=np.stack([b["targets"] for b in batches]).astype(np.int64))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tempfile.mkdtemp(dir=work, prefix="out-")
    env = {**START_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child-torch", str(r), str(ranks),
                               directory, "--out", out, "--steps", str(steps)], env=env) for r in range(ranks)]
    codes = [p.wait(timeout=900) for p in procs]
    if any(codes):
        raise SystemExit(f"PyTorch FSDP2's run failed (exit codes {codes})")
    return {"ranks": _gather(out, ranks)}


# ----------------------------------------------------------------------------- the comparison


def _summary(run: dict) -> tuple[float, float, float]:
    """Return (peak growth, ru_maxrss, step time) of a run: the largest rank's memory, the slowest
    rank's median step after the first."""
    ranks = run["ranks"]
    step = max(statistics.median(r["step_s"][1:] or r["step_s"]) for r in ranks)
    return max(r["growth"] for r in ranks), max(r["maxrss"] for r in ranks), step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/memory_vs_fsdp.py")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child-hspmd", metavar="BUNDLE")
    parser.add_argument("--child-torch", nargs=3, metavar=("RANK", "WORLD", "DIR"))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.child_hspmd:
        sys.path.insert(0, ROOT)
        return hspmd_child(args.child_hspmd, args.out, args.steps)
    if args.child_torch:
        rank, world, directory = args.child_torch
        return torch_child(int(rank), int(world), directory, args.out, args.steps)

    sys.path.insert(0, ROOT)
    from hspmd.frontend.script import load_script, parse_overrides

    overrides = [f"model.layers={args.layers}", f"model.d_model={args.d_model}", f"model.heads={args.heads}",
                 f"model.seq_len={args.seq}", f"data.batch_size={args.batch}"]
    script = load_script(os.path.join(ROOT, "examples", "gpt.py"), parse_overrides(overrides))
    batches = [b for _, b in zip(range(args.steps), script.batches())]
    o = script.config["optim"]
    settings = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
                "batch": args.batch, "vocab": script.config["model"]["vocab_size"], "lr": o["lr"],
                "weight_decay": o["weight_decay"], "clip": o["clip"]}
    n = args.ranks
    mib = 2.0 ** 20
    print(f"GPT L{args.layers} d{args.d_model} h{args.heads} T{args.seq}, vocabulary 256, global batch {args.batch}, "
          f"{n} CPU ranks, {args.steps} steps (the first not timed)")
    with tempfile.TemporaryDirectory(prefix="hspmd-memory-") as work:
        both = run_hspmd(script, f"[0-{n - 1}]: dp={n} zero=3 recompute=block", n, args.steps, work)
        zero3 = run_hspmd(script, f"[0-{n - 1}]: dp={n} zero=3", n, args.steps, work)
        fsdp = run_torch(settings, batches, n, args.steps, work)
    rows = [("hspmd zero=3 recompute=block", both), ("hspmd zero=3", zero3),
            ("PyTorch FSDP2 + checkpoint_wrapper (gloo)", fsdp)]
    print(f"{'run':<44}{'peak growth MiB':>16}{'ru_maxrss MiB':>15}{'step s':>9}{'planned peak MiB':>18}  losses")
    for name, run in rows:
        growth, maxrss, step = _summary(run)
        planned = f"{run['planned_peak'] / mib:.1f}" if "planned_peak" in run else "-"
        losses = " ".join(f"{v:.4f}" for v in run["ranks"][0]["losses"])
        print(f"{name:<44}{growth / mib:>16.1f}{maxrss / mib:>15.1f}{step:>9.2f}{planned:>18}  {losses}")
    g_both, _, t_both = _summary(both)
    g_z3, _, t_z3 = _summary(zero3)
    g_fsdp, _, t_fsdp = _summary(fsdp)
    print(f"activations kept for the backward (planned, per rank): recompute=block {both['activations'] / mib:.1f} MiB, "
          f"without {zero3['activations'] / mib:.1f} MiB: ratio {both['activations'] / zero3['activations']:.3f} "
          f"(target <= {2 / args.layers:.3f})")
    print(f"step time recompute=block / without: {t_both / t_z3:.3f} (target <= 1.4)")
    print(f"planned peak / measured peak growth, zero=3 recompute=block: {both['planned_peak'] / g_both:.3f} "
          f"(target within 10%)")
    print(f"step time hspmd zero=3 recompute=block / FSDP2 + checkpointing: {t_both / t_fsdp:.3f} (target <= 1.0)")
    print(f"peak memory per rank hspmd zero=3 recompute=block / FSDP2 + checkpointing: {g_both / g_fsdp:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
