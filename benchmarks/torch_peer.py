"""PyTorch as its users run it: GPT-tiny's step in a process of its own, with PyTorch's defaults.

`step_vs_torch.py` and `step_floor.py` time hspmd's step against PyTorch's. PyTorch must not run
inside hspmd's process: hspmd's fused CPU kernels want `OMP_WAIT_POLICY=passive`, which made
PyTorch eager's step 17% slower (247 against 211 ms, issue 31), and a user's PyTorch runs with
its own defaults. So the peer runs here, in a child process started with the environment the
benchmark itself was started with (nothing of hspmd's set, hspmd not imported), and answers a
line protocol on stdin/stdout, one step per request, so that the parent can still alternate
the runners step by step (a machine shared with other work slows both alike):

    parent: "step I\\n"   child: "<seconds>\\n"   (the step's time, measured in the child)
    parent: "quit\\n"

The model, its initial parameters and the batches come from files the parent writes (NumPy
`.npz`, one JSON of sizes and optimizer settings): `write_inputs`. `Peer` is the parent's
handle; `--env passive` starts the child with `OMP_WAIT_POLICY=passive` (the old, handicapped
setting, for a column beside the fair one).

    python benchmarks/torch_peer.py DIR [--compile]     (what Peer starts)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: the environment this process started with (before any benchmark sets anything), for the peers;
#: NumPy is imported inside the functions, so that importing this module loads no BLAS before the
#: benchmark sets OPENBLAS_THREAD_TIMEOUT for hspmd's side
START_ENV = dict(os.environ)


def torch_loss(p: dict, ids, targets, heads: int, eps: float):
    """The loss of hspmd.frontend.transformer's GPT in plain PyTorch (head-major fused qkv)."""
    import torch

    F = torch.nn.functional
    b, t = ids.shape
    x = p["wte.weight"][ids] + p["wpe"][:t]
    layers = len({k.split(".")[1] for k in p if k.startswith("blocks.")})
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=ids.device), 1)
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
    # float32 logits for the loss (under autocast they are bfloat16), as hspmd's loss computes
    return F.cross_entropy((x @ p["head.weight"]).reshape(b * t, -1).float(), targets.reshape(-1))


class Torch:
    """PyTorch's side: the same parameters, AdamW and clipping as the script's optimizer.

    `settings`: {"heads", "eps", "lr", "weight_decay", "clip"}. `compiled`: the loss (forward and
    backward) through `torch.compile` (inductor, the CPU's C++/OpenMP code); the optimizer step
    and the clipping stay eager, as in PyTorch's own recipe. The first step compiles (tens of
    seconds).
    """

    def __init__(self, settings: dict, params: dict, compiled: bool = False) -> None:
        import torch

        self.torch = torch
        self.loss_fn = torch.compile(torch_loss, dynamic=False) if compiled else torch_loss
        self.heads, self.eps = settings["heads"], settings["eps"]
        self.params = {k: torch.tensor(v, requires_grad=True) for k, v in params.items() if not k.startswith("opt.")}
        self.clip = settings.get("clip") or 0.0
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=settings["lr"],
                                     weight_decay=settings["weight_decay"])

    def step(self, batch) -> float:
        import numpy as np

        torch = self.torch
        ids, targets = (torch.from_numpy(np.asarray(batch[k], dtype=np.int64)) for k in ("ids", "targets"))
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.params, ids, targets, self.heads, self.eps)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip)
        self.opt.step()
        return float(loss.detach())


def write_inputs(directory: str, settings: dict, params: dict, batches: list[dict]) -> None:
    """Write what a peer reads: the settings, the initial parameters (one tensor per layer) and
    the batches, in order."""
    import numpy as np

    with open(os.path.join(directory, "settings.json"), "w") as f:
        json.dump(settings, f)
    np.savez(os.path.join(directory, "params.npz"), **params)
    np.savez(os.path.join(directory, "batches.npz"),
             **{f"{k}.{i}": v for i, b in enumerate(batches) for k, v in b.items()})


def read_inputs(directory: str) -> tuple[dict, dict, list[dict]]:
    """Return what `write_inputs` wrote."""
    import numpy as np

    settings = json.load(open(os.path.join(directory, "settings.json")))
    params = dict(np.load(os.path.join(directory, "params.npz")))
    raw = np.load(os.path.join(directory, "batches.npz"))
    batches: dict[int, dict] = {}
    for key in raw.files:
        name, i = key.rsplit(".", 1)
        batches.setdefault(int(i), {})[name] = raw[key]
    return settings, params, [batches[i] for i in sorted(batches)]


class Peer:
    """The parent's handle of a PyTorch process: `step(i)` runs batch i there and returns its time.

    `env`: "default" (the benchmark's own starting environment: PyTorch as its users run it) or
    "passive" (the same with OMP_WAIT_POLICY=passive, as hspmd's kernels set for themselves)."""

    def __init__(self, directory: str, compiled: bool = False, env: str = "default") -> None:
        environ = dict(START_ENV)
        if env == "passive":
            environ["OMP_WAIT_POLICY"] = "passive"
        cmd = [sys.executable, os.path.abspath(__file__), directory] + (["--compile"] if compiled else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=environ)
        ready = self.proc.stdout.readline().split()  # "ready LOSS THREADS VERSION" after the first (compiling) step
        if not ready or ready[0] != "ready":
            self.proc.kill()
            raise RuntimeError(f"the PyTorch peer did not start: {' '.join(ready) or 'no answer'}")
        self.first_loss, self.threads, self.version = float(ready[1]), int(ready[2]), ready[3]

    def step(self, i: int) -> float:
        self.proc.stdin.write(f"step {i}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError("the PyTorch peer ended")
        return float(answer)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(60)


def child(directory: str, compiled: bool) -> int:
    """Serve steps of PyTorch's GPT-tiny (the `Peer` protocol)."""
    import torch

    settings, params, batches = read_inputs(directory)
    try:
        runner = Torch(settings, params, compiled)
        first = runner.step(batches[0])
    except Exception as err:  # inductor raises many kinds (BackendCompilerFailed, CalledProcessError, ...)
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        print(f"failed {type(err).__name__}: {why[:200]}", flush=True)
        return 1
    print(f"ready {first!r} {torch.get_num_threads()} {torch.__version__}", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        start = time.perf_counter()
        runner.step(batches[int(words[1])])
        print(repr(time.perf_counter() - start), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory")
    parser.add_argument("--compile", action="store_true")
    a = parser.parse_args()
    sys.exit(child(a.directory, a.compile))
