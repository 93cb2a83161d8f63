"""One training step of the GPT of examples/gpt.py on one GPU: hspmd against PyTorch CUDA.

    python benchmarks/gpu_step_vs_torch.py [--sizes tiny,medium,gpt2:bfloat16] [--steps 20] [--warmup 3]
                                           [--compile-at medium:float32,gpt2:bfloat16] [--no-cuda-graph]

Sizes: tiny (L2 d128 h4 T64 B16), medium (L6 d512 h8 T256 B16), gpt2 (the GPT-2-small shape:
L12 d768 h12 T1024 B8), byte-level vocabulary, AdamW with weight decay and clipping as the
script's optimizer; each in float32 and bfloat16, or in one (`SIZE:PRECISION`). hspmd runs its
GPU plan (`hspmd run --device cuda`: the whole step on the device, captured as a CUDA graph
after its first step); PyTorch runs the same model (started from hspmd's initial parameters)
eagerly and, where `--compile-at` names the configuration (default: where a target asks for
it, `TARGETS`), through `torch.compile`, with its defaults (torch.optim.AdamW,
clip_grad_norm_), TF32 off on both sides for float32. The runners take turns step by step in
one process; each step is timed to its end on the device (the loss read back). bfloat16:
PyTorch with autocast, hspmd with the script's `precision=bfloat16` (float32 master weights,
bfloat16 products on the tensor cores, softmax, norms and the loss in float32).

Printed per configuration: the median step times, hspmd / eager and hspmd / torch.compile, the
CUDA graphs hspmd captured, the peak device memory (hspmd's arena, and all it holds with
cuBLAS's workspace; PyTorch eager's `torch.cuda.max_memory_allocated` over its own warm-up
steps, before another runner exists), then each target of issue 38 met or missed, and last the
headline: hspmd / PyTorch eager at the last configuration run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_peer import torch_loss  # the same GPT in PyTorch as the CPU benchmark's peer

PRECISIONS = ("float32", "bfloat16")
SIZES = {
    "tiny": {"model.layers": 2, "model.d_model": 128, "model.heads": 4, "model.seq_len": 64, "data.batch_size": 16},
    "medium": {"model.layers": 6, "model.d_model": 512, "model.heads": 8, "model.seq_len": 256, "data.batch_size": 16},
    "gpt2": {"model.layers": 12, "model.d_model": 768, "model.heads": 12, "model.seq_len": 1024, "data.batch_size": 8},
}
#: issue 38's targets, per (size, precision): the largest hspmd / eager and hspmd / torch.compile
TARGETS = {
    ("tiny", "float32"): {"eager": 0.5},
    ("medium", "float32"): {"eager": 1.0, "compile": 1.15},
    ("gpt2", "float32"): {"eager": 1.0, "compile": 1.15},
    ("medium", "bfloat16"): {"eager": 1.0},
    ("gpt2", "bfloat16"): {"eager": 1.0, "compile": 1.0},
}


class Hspmd:
    """hspmd's GPU plan of the script's step, and its state on the device."""

    def __init__(self, script, cuda_graph: bool) -> None:
        from hspmd.compiler import compile_script
        from hspmd.runtime.cuda.cupy_device import CupyDevice
        from hspmd.runtime.cuda.plan import build_device_plan
        from hspmd.runtime.worker import step_inputs

        compiled = compile_script(script, "[0]: dp=1", 1)
        ((_, program),) = compiled.device_groups()
        fn = next(op for op in program.body.block.ops if getattr(op, "sym_name", None) is not None
                  and op.sym_name.data == "train_step")
        self.device = CupyDevice(0)
        self.plan = build_device_plan(fn, 0, self.device, cuda_graph=cuda_graph)
        self.state = self.plan.initial_state(int(script.config.get("seed", 0)))
        import cupy

        self.held_bytes = cupy.get_default_memory_pool().used_bytes()  # the arena, cuBLAS's workspace, staging
        self.config = {**script.config, "lr_schedule": compiled.lr_schedule}
        self.names = {leaf.name for leaf in self.plan.inputs}
        self.step_inputs, self.n = step_inputs, 0

    def params(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.state.items()}

    def step(self, batch) -> float:
        self.n += 1
        inputs = self.plan.local_batch({**batch, **self.step_inputs(self.n, self.config, self.names)})
        return float(self.plan.run(self.state, inputs)["loss"])  # the loss comes back: the step has ended


class Torch:
    """PyTorch CUDA: the same parameters, AdamW and clipping; eager or through torch.compile."""

    def __init__(self, script, params: dict[str, np.ndarray], compiled: bool, bf16: bool) -> None:
        import torch

        from hspmd.runtime.stacked import per_layer

        self.torch = torch
        cfg, o = script.config, script.config["optim"]
        self.heads, self.eps = cfg["model"]["heads"], cfg["model"].get("eps", 1e-5)
        self.params = {k: torch.tensor(v, device="cuda", requires_grad=True)
                       for k, v in per_layer(params).items() if not k.startswith("opt.")}
        self.loss_fn = torch.compile(torch_loss, dynamic=False) if compiled else torch_loss
        self.clip, self.bf16 = o.get("clip") or 0.0, bf16
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=o["lr"], weight_decay=o["weight_decay"])

    def step(self, batch) -> float:
        torch = self.torch
        ids, targets = (torch.from_numpy(np.asarray(batch[k], dtype=np.int64)).cuda(non_blocking=True)
                        for k in ("ids", "targets"))
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            loss = self.loss_fn(self.params, ids, targets, self.heads, self.eps)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip)
        self.opt.step()
        return float(loss.detach())  # synchronizes: the step has ended


def alternate(runners: dict, batches, steps: int, warmup: int) -> dict[str, float]:
    """Return each runner's median step time (seconds) over `steps` steps after `warmup`, the
    runners taking turns step by step."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for i in range(warmup + steps):
        batch = next(batches)
        for name in order[i % len(order):] + order[:i % len(order)]:
            start = time.perf_counter()
            runners[name].step(batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def eager_peak_mib(runner: Torch, batches, steps: int) -> float:
    """Return PyTorch eager's peak device memory (MiB) over `steps` steps of its own (no other
    PyTorch runner alive yet: `max_memory_allocated` is its alone)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(max(steps, 1)):
        runner.step(next(batches))
    return torch.cuda.max_memory_allocated() / 2**20


def run_config(size: str, precision: str, compile_at: set, args) -> float:
    """Benchmark one size in one precision, print its line and its targets; return hspmd / eager
    (nan where hspmd did not run)."""
    import torch

    from hspmd.frontend.script import load_script

    began = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    script = load_script(os.path.join(ROOT, "examples", "gpt.py"),
                         {**SIZES[size], "model.dropout": 0.0, "precision": precision})
    runners: dict = {}
    why = ""
    params = None
    try:
        runners["hspmd"] = Hspmd(script, not args.no_cuda_graph)
        params = runners["hspmd"].params()
    except Exception as err:  # noqa: BLE001 - say why and go on with PyTorch's columns
        why = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    if params is None:
        params = _initial_params(script)
    bf16 = precision == "bfloat16"
    batches = script.batches()
    runners["eager"] = Torch(script, params, compiled=False, bf16=bf16)
    peak_eager = eager_peak_mib(runners["eager"], batches, args.warmup)
    if (size, precision) in compile_at:
        try:
            runners["compile"] = Torch(script, params, compiled=True, bf16=bf16)
        except Exception as err:  # noqa: BLE001
            print(f"  torch.compile unavailable: {type(err).__name__}: {err}", flush=True)
    medians = alternate(runners, batches, args.steps, args.warmup)
    line = f"{size} {precision}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in medians.items())
    ratios: dict[str, float] = {}
    if "hspmd" in medians:
        h = runners["hspmd"]
        ratios["eager"] = medians["hspmd"] / medians["eager"]
        line += f"; hspmd/eager {ratios['eager']:.3f}"
        if "compile" in medians:
            ratios["compile"] = medians["hspmd"] / medians["compile"]
            line += f", hspmd/compile {ratios['compile']:.3f}"
        failures = h.plan.capture_failures
        line += (f"; CUDA graphs captured {h.plan.graphs_captured}{f' (refused: {failures[0]})' if failures else ''}"
                 f"; peak MiB hspmd {h.plan.peak_bytes / 2**20:.0f} (arena), {h.held_bytes / 2**20:.0f} (held), "
                 f"PyTorch eager {peak_eager:.0f}")
        ratios["memory"] = h.held_bytes / 2**20 / peak_eager
    else:
        line += f"; hspmd: {why}"
    print(f"{line} [{time.perf_counter() - began:.0f} s with the plans and compiles]", flush=True)
    for what, most in {**TARGETS.get((size, precision), {}), "memory": 1.0}.items():
        got = ratios.get(what)
        verdict = "not measured" if got is None else f"{got:.3f} {'met' if got <= most else 'MISSED'}"
        name = "peak memory / eager's" if what == "memory" else f"hspmd / {'torch.compile' if what == 'compile' else what}"
        print(f"  target {size} {precision} {name} <= {most}: {verdict}", flush=True)
    del runners
    torch.cuda.empty_cache()
    return ratios.get("eager", math.nan)


def parse_configs(text: str) -> list[tuple[str, str]]:
    """Return the (size, precision) pairs of `--sizes` (`SIZE` for both precisions, `SIZE:PRECISION` for one)."""
    out = []
    for item in (i for i in text.split(",") if i):
        size, _, precision = item.partition(":")
        precision = {"bf16": "bfloat16", "f32": "float32"}.get(precision, precision)
        if size not in SIZES or precision not in ("", *PRECISIONS):
            raise ValueError(f"unknown configuration '{item}' (sizes {', '.join(SIZES)}; precisions "
                             f"{', '.join(PRECISIONS)})")
        out += [(size, p) for p in ([precision] if precision else PRECISIONS)]
    return out


def _initial_params(script) -> dict[str, np.ndarray]:
    """Return the script's initial parameters as the plans make them (global arrays)."""
    from hspmd.compiler import compile_script
    from hspmd.dialects import graph
    from hspmd.ir.init_spec import initial_value

    compiled, seed = compile_script(script, "[0]: dp=1", 1), int(script.config.get("seed", 0))
    out = {}
    for op in compiled.logical.walk():
        if isinstance(op, graph.ParameterOp):
            name = op.tensor_name.data
            shape = tuple(op.result.type.get_shape())
            out[name] = initial_value(op.init.data, shape, "float32", name, seed)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,medium,gpt2",
                        help="configurations: SIZE (float32 and bfloat16) or SIZE:PRECISION, comma-separated")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-at", default=",".join(f"{s}:{p}" for (s, p), t in TARGETS.items() if "compile" in t),
                        help="the configurations PyTorch also runs through torch.compile ('all', 'none'; default: "
                             "those a target asks for)")
    parser.add_argument("--no-torch-compile", action="store_true", help="the same as --compile-at none")
    parser.add_argument("--no-cuda-graph", action="store_true")
    args = parser.parse_args()
    from hspmd.codegen.cupy_backend import gpu_status

    try:
        configs = parse_configs(args.sizes)
        compile_at = (set() if args.no_torch_compile or args.compile_at == "none" else set(configs)
                      if args.compile_at == "all" else set(parse_configs(args.compile_at)))
    except ValueError as err:
        print(err)
        return 2
    ok, why = gpu_status()
    if not ok:
        print(f"needs a CUDA GPU and CuPy: {why}")
        return 2
    ratio = math.nan
    for size, precision in configs:
        ratio = run_config(size, precision, compile_at, args)
    size, precision = configs[-1]
    print(f"headline: hspmd / PyTorch eager, {size} {precision}: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
