"""Compile time and IR size of GPT against its layer count.

    python benchmarks/compile_scaling.py [--layers 2 24 96] [--repeat 1] [--strategy "[0-3]: pp=4"]

Runs `hspmd compile examples/gpt.py --set model.layers=L --dump-dir D` (the whole CLI, as a
user runs it: Python's start, tracing, every pass, the dumps) for each L, and reads the size of
each level's dump in D. Printed: one line per layer count (seconds, the best of `--repeat`
runs; bytes of the logical, physical and kernel-level dumps), then the ratios of the largest
layer count to the smallest: the physical IR's size, and last the compile time. The issue's
targets: physical IR size 96 / 2 <= 1.5 and compile time 96 / 2 <= 2.0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_once(layers: int, folder: str, strategy: str | None = None) -> float:
    """Return the seconds of one `hspmd compile` of GPT with `layers` layers (under `strategy`, else
    the default one device), dumping into `folder`."""
    cmd = [sys.executable, "-m", "hspmd.cli.main", "compile", os.path.join(ROOT, "examples", "gpt.py"),
           "--set", f"model.layers={layers}", "--dump-dir", folder, *(["--strategy", strategy] if strategy else [])]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"hspmd compile failed at {layers} layers:\n{proc.stdout}{proc.stderr}")
    return seconds


def dump_bytes(folder: str, prefix: str) -> int:
    """Return the bytes of the dumps in `folder` whose names start with `prefix`."""
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.startswith(prefix))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 24, 96], help="layer counts (default 2 24 96)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per layer count; the best counts (default 1)")
    parser.add_argument("--strategy", default=None, help="compile under this strategy (default: one device); "
                        "a pipeline's dumps are one per stage, their sizes summed")
    args = parser.parse_args()
    rows = {}
    print(f"GPT (examples/gpt.py defaults), `hspmd compile --dump-dir`"
          f"{' --strategy ' + repr(args.strategy) if args.strategy else ''}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'layers':>6} {'seconds':>8} {'logical':>10} {'physical':>10} {'kernel':>10}")
    for layers in args.layers:
        best = None
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="hspmd-scaling-") as folder:
                seconds = compile_once(layers, folder, args.strategy)
                sizes = tuple(dump_bytes(folder, p) for p in ("logical", "physical", "kernel"))
            best = seconds if best is None else min(best, seconds)
        rows[layers] = (best, *sizes)
        print(f"{layers:>6} {best:>8.2f} {sizes[0]:>10} {sizes[1]:>10} {sizes[2]:>10}")
    lo, hi = min(rows), max(rows)
    print(f"physical IR size {hi} layers / {lo} layers: {rows[hi][2] / rows[lo][2]:.2f}")
    print(f"compile time {hi} layers / {lo} layers: {rows[hi][0] / rows[lo][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
