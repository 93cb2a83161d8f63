"""Compile time, bundle bytes and peak memory against the number of devices; `hspmd plan` at 16,384.

    python benchmarks/compile_devices.py [--repeat 1] [--big 65536] [--plan-gpus 16384] [--no-plan]

Runs the whole CLI as a user does, each in a child process measured from outside:
`hspmd compile examples/gpt.py` (GPT, 12 layers, d 768, 16 heads, a batch of 16,384 rows) under
`[0-7]: dp=2 tp=4` and under `[0-65535]: dp=8192 tp=8`, with `--dump-dir`; then
`hspmd plan -n 16384 --profile h100x16384.json` on the same model, with the synthetic 2,048-node
H100 profile `tools/gpu_paper_plan.py --write-profiles` writes (and, with `--slow-nodes`, the
same cluster with a third of its nodes half as fast). Printed: per device count the seconds (the
best of `--repeat`), the bundle's bytes and the child's peak resident memory (its maximum RSS),
then the plan's seconds, and the ratios 65,536 / 8 devices. The issue's targets: compile time
<= 1.5, bundle bytes <= 1.2, peak memory <= 1.5, `hspmd plan` at 16,384 devices <= 60 s. The
last number of the last line is the compile-time ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--set", "model.layers=12", "--set", "model.d_model=768", "--set", "model.heads=16",
         "--set", "data.batch_size=16384"]


#: runs the command in a child of its own and prints that child's peak resident KiB and its CPU
#: seconds (getrusage of the children of a fresh process: nothing else it ran counts)
_PEAK = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
         "r = resource.getrusage(resource.RUSAGE_CHILDREN); "
         "print(r.ru_maxrss, r.ru_utime + r.ru_stime, file=sys.stderr); sys.exit(p.returncode)")


def run(args: list[str], what: str) -> tuple[float, int, float]:
    """Return (seconds, peak resident bytes, CPU seconds) of `python -m hspmd.cli.main ARGS` in a
    child process (on a loaded machine the CPU seconds say more than the wall's)."""
    cmd = [sys.executable, "-c", _PEAK, sys.executable, "-m", "hspmd.cli.main", *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rss, cpu = proc.stderr.strip().splitlines()[-1].split()
    return seconds, int(rss) * 1024, float(cpu)


def bundle_bytes(folder: str) -> int:
    """Return the bytes of every file of the bundle in `folder`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def compile_at(n: int, strategy: str, repeat: int) -> tuple[float, int, int]:
    """Return (best seconds, bundle bytes, peak bytes) of compiling GPT for `n` devices under `strategy`."""
    best, size, peak = None, 0, 0
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="hspmd-devices-") as folder:
            seconds, rss, _ = run(["compile", os.path.join(ROOT, "examples", "gpt.py"), "--strategy", strategy, "-n", str(n),
                                *MODEL, "--dump-dir", folder], f"hspmd compile at {n} devices")
            size = bundle_bytes(folder)
        best = seconds if best is None else min(best, seconds)
        peak = max(peak, rss)
    return best, size, peak


def plan_at(gpus: int, folder: str, profile: str) -> tuple[float, float]:
    """Return the (wall, CPU) seconds of `hspmd plan -n GPUS --profile FOLDER/PROFILE.json` for the GPT."""
    seconds, _, cpu = run(["plan", os.path.join(ROOT, "examples", "gpt.py"), "-n", str(gpus), "--profile",
                      os.path.join(folder, profile), *MODEL], f"hspmd plan at {gpus} devices")
    return seconds, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="compiles per device count; the best counts (default 1)")
    parser.add_argument("--big", type=int, default=65536, help="the large device count (dp = big / 8, tp = 8)")
    parser.add_argument("--plan-gpus", type=int, default=16384, help="GPUs of the planned H100 cluster (default 16384)")
    parser.add_argument("--no-plan", action="store_true", help="skip hspmd plan")
    args = parser.parse_args()
    print(f"GPT 12 layers, d 768, 16 heads, 16,384 rows; `hspmd compile --dump-dir` as a child process; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'devices':>8} {'strategy':<26} {'seconds':>8} {'bundle bytes':>13} {'peak MiB':>9}")
    rows = {}
    for n, strategy in ((8, "[0-7]: dp=2 tp=4"), (args.big, f"[0-{args.big - 1}]: dp={args.big // 8} tp=8")):
        rows[n] = compile_at(n, strategy, args.repeat)
        print(f"{n:>8} {strategy:<26} {rows[n][0]:>8.2f} {rows[n][1]:>13,} {rows[n][2] / 2**20:>9.1f}", flush=True)
    if not args.no_plan:
        with tempfile.TemporaryDirectory(prefix="hspmd-h100-") as folder:
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_paper_plan.py"), "--write-profiles", folder,
                            "--gpus", str(args.plan_gpus), "--slow-nodes", "0.333"], check=True, cwd=ROOT,
                           capture_output=True)
            for name in (f"h100x{args.plan_gpus}.json", f"h100x{args.plan_gpus}-slow.json"):
                wall, cpu = plan_at(args.plan_gpus, folder, name)
                print(f"hspmd plan -n {args.plan_gpus} --profile {name}: {wall:.1f} s ({cpu:.1f} CPU-s; target <= 60 s)",
                      flush=True)
    small, big = rows[8], rows[args.big]
    print(f"peak compile memory {args.big} / 8 devices: {big[2] / small[2]:.2f} (target <= 1.5)")
    print(f"bundle bytes {args.big} / 8 devices: {big[1] / small[1]:.2f} (target <= 1.2)")
    print(f"compile time {args.big} / 8 devices: {big[0] / small[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
