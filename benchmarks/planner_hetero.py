"""The planner on ranks of unequal speed: `--strategy auto` against the best of a hand sweep.

    python benchmarks/planner_hetero.py [--steps 12] [--cores 0,0,1]

Three ranks of GPT (examples/gpt.py, its defaults), pinned to cores (`--cpu-bind`): by default
ranks 0 and 1 share core 0 and rank 2 has core 1 to itself, so rank 2 computes about twice as
fast as either of the others (on a machine with two idle cores). The benchmark

1. measures a device profile of the three ranks (`hspmd profile -n 3 --cpu-bind ...`);
2. plans with it (`hspmd plan ... --profile`), the strategy `--strategy auto` would run;
3. runs the planned strategy and a sweep of hand-written ones a person would try (data
   parallel with batch shares 1:1, 1:3, 3:1 and 3:5 between the pair and the fast rank, a
   tensor-parallel pair beside it, even rows per rank where the rows divide) for `--steps`
   steps each, alternating, and takes each one's median step time (rank 0's `time_s`, which
   includes the wait for the slowest rank at the gradient sum; the first 3 steps dropped).

"Ideal" is the fastest step time measured over the sweep and the plan. The last line ends with
auto / ideal as throughput, ideal time / auto time (1.0: the planner found the best).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "gpt.py")
SWEEP = [
    "[0,1]: dp=2 share=1 | [2]: dp=1 share=1",
    "[0,1]: dp=2 share=1 | [2]: dp=1 share=3",
    "[0,1]: dp=2 share=3 | [2]: dp=1 share=1",
    "[0,1]: dp=2 share=3 | [2]: dp=1 share=5",
    "[0,1]: dp=1 tp=2 share=1 | [2]: dp=1 share=1",
    "[0,1]: dp=1 tp=2 share=1 | [2]: dp=1 share=3",
]


def hspmd(*args: str, timeout: int = 600) -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "hspmd")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"hspmd {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def step_time(strategy: str, settings: list[str], cores: str, steps: int, directory: str) -> float:
    log = os.path.join(directory, "log.jsonl")
    sets = [a for s in settings for a in ("--set", s)]
    hspmd("run", "-n", "3", SCRIPT, "--strategy", strategy, "--cpu-bind", cores, "--steps", str(steps),
          "--log", log, *sets)
    times = [json.loads(line)["time_s"] for line in open(log) if line.startswith("{")]
    return statistics.median(times[3:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per run (default 12; the first 3 dropped)")
    parser.add_argument("--cores", default="0,0,1", help="the core of each of the 3 ranks (default 0,0,1)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each strategy, alternating (default 2)")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="hspmd-planbench-")
    try:
        profile = os.path.join(directory, "profile.json")
        hspmd("profile", "-n", "3", "--cpu-bind", args.cores, "-o", profile)
        with open(profile) as f:
            rates = [r["matmul"][-1]["gflops"] for r in json.load(f)["ranks"]]
        print("profile (--cpu-bind " + args.cores + "): matmul GFLOP/s per rank at the largest shape: "
              + ", ".join(f"{g:.1f}" for g in rates))
        out = hspmd("plan", SCRIPT, "-n", "3", "--profile", profile).strip().splitlines()
        auto = out[-1].strip()
        settings = next((line.split(": ", 1)[1].replace("--set ", "").split() for line in out
                         if line.startswith("run it with: ")), [])
        print(f"planned: {auto} {' '.join(settings)}")
        cases = [(auto, settings)] + [(s, []) for s in SWEEP if s != auto]
        times: dict[str, list[float]] = {s: [] for s, _ in cases}
        for _ in range(args.rounds):
            for strategy, sets in cases:
                times[strategy].append(step_time(strategy, sets, args.cores, args.steps, directory))
        med = {s: statistics.median(t) for s, t in times.items()}
        for s, t in sorted(med.items(), key=lambda kv: kv[1]):
            print(f"  {t * 1e3:8.1f} ms  {s}{'   (auto)' if s == auto else ''}")
        ideal = min(med.values())
        print(f"auto {med[auto] * 1e3:.1f} ms per step, ideal (best measured) {ideal * 1e3:.1f} ms; "
              f"auto / ideal throughput {ideal / med[auto]:.3f}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
