"""A GPU rank and a CPU rank in one job: the planner's shares against a sweep of shares.

Issue 28's done-when: `--strategy auto` over one GPU rank and one CPU rank chooses shares within
10% of the best of a sweep. This script profiles the two ranks (`hspmd profile -n 2 --device
cuda,cpu`), asks the planner (`hspmd plan --profile`), then times `hspmd run -n 2` under the
planner's strategy and under `[0]: dp=1 device=cuda share=a | [1]: dp=1 device=cpu share=b` for
each a:b of the sweep (and the GPU rank alone, the CPU rank idle, which the planner may choose) (the median step time of the steps after the first two), and prints the
sweep, the planner's choice, and last the ratio of the planner's step time to the sweep's best.

On the GPU machine (`benchmarks/gpu_check.sh` sets up its environment):

    python3 benchmarks/gpu_cpu_shares.py --steps 12

Here, without a GPU, `HSPMD_EMULATE_GPU=1` runs it on the emulated device (a check of the
script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hspmd(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run the hspmd CLI (this checkout's) and return the finished process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "hspmd.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def step_ms(log: str, skip: int = 2) -> float:
    """Return the median step time (ms) of a run's log, after its first `skip` steps."""
    times = [json.loads(line)["time_s"] for line in open(log).read().splitlines()]
    return 1e3 * statistics.median(times[skip:] or times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--script", default=os.path.join(ROOT, "examples", "gpt.py"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides (default: data.batch_size=64)")
    p.add_argument("--shares", default="1:0,1:1,3:1,7:1,15:1,31:1,63:1",
                   help="the sweep, GPU:CPU (1:0: the GPU rank alone, the CPU rank idle)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=240)
    args = p.parse_args()
    sets = [a for kv in (args.set or ["data.batch_size=64"]) for a in ("--set", kv)]
    work = tempfile.mkdtemp(prefix="hspmd-shares-")
    profile = os.path.join(work, "profile.json")
    out = hspmd("profile", "-n", "2", "--device", "cuda,cpu", "-o", profile, timeout=args.timeout)
    if out.returncode:
        print(f"profile failed: {(out.stdout + out.stderr)[-800:]}")
        return 1
    out = hspmd("plan", args.script, "-n", "2", "--profile", profile, "--top", "3", *sets, timeout=args.timeout)
    lines = out.stdout.strip().splitlines()
    at = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("strategy")), None)
    if out.returncode or at is None or at + 1 >= len(lines):
        print(f"plan failed: {(out.stdout + out.stderr)[-800:]}")
        return 1
    planned = lines[at + 1].strip()
    print("\n".join(lines[max(0, at - 5):at]))

    def timed(strategy: str, name: str) -> float | None:
        log = os.path.join(work, f"{name}.jsonl")
        run = hspmd("run", "-n", "2", args.script, "--strategy", strategy, "--steps", str(args.steps), "--log", log,
                    *sets, timeout=args.timeout)
        if run.returncode:
            print(f"  {strategy}: failed: {(run.stdout + run.stderr)[-400:]}")
            return None
        return step_ms(log)

    sweep = {}
    print(f"{'GPU:CPU':>8}  {'step ms':>8}  strategy")
    for pair in args.shares.split(","):
        a, b = (int(x) for x in pair.split(":"))
        strategy = (f"[0]: dp=1 device=cuda share={a} | [1]: dp=1 device=cpu share={b}" if b
                    else "[0]: dp=1 device=cuda")  # rank 1 idle (docs/planning.md, "Idle ranks")
        ms = timed(strategy, f"sweep-{a}-{b}")
        if ms is not None:
            sweep[pair] = ms
            print(f"{pair:>8}  {ms:8.2f}  {strategy}", flush=True)
    auto = timed(planned, "planned")
    if not sweep or auto is None:
        print("no ratio: a run failed")
        return 1
    best = min(sweep, key=sweep.get)  # type: ignore[arg-type]
    print(f"planned: {planned}: {auto:.2f} ms; best of the sweep {best}: {sweep[best]:.2f} ms")
    speed = sweep[best] / auto  # the planner's shares' speed as a fraction of the sweep's best
    print(f"target: the planner's shares at >= 0.9 of the sweep's best: {speed:.3f} {'met' if speed >= 0.9 else 'MISSED'}")
    print(f"planned step time / best of the sweep: {auto / sweep[best]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
