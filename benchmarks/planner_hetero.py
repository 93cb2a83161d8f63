"""The planner on ranks of unequal speed: `--strategy auto` against uniform `dp=3` and the ideal.

    python benchmarks/planner_hetero.py [--steps 24] [--cores 0,0,1] [--rounds 2]

Three ranks of GPT (examples/gpt.py: 2 layers, 64 sequences per step), one BLAS thread each,
pinned to cores with `--cpu-bind`: by default ranks 0 and 1 share core 0 and rank 2 has core 1
to itself, so their speeds are about 1:1:2. The benchmark

1. plans for 8, 64 and 512 virtual devices from a synthetic profile (half of them twice as
   fast; the batch grown to n/2 rows so that every device can be busy) and prints how long
   each took, the probe compiles included (the issue's bound: 10 s);
2. measures each rank's own speed under the same pinning: three one-rank runs at once (no
   communication), each training on the whole batch; a rank's speed is its sequences per
   second, and **ideal** is their sum;
3. measures a device profile of the three pinned ranks (`hspmd profile --cpu-bind`), plans
   with it and runs `--strategy auto`, and runs uniform `[0-2]: dp=3` (64 rows: 22, 21, 21), each
   for `--steps` steps (the first 4 dropped: 20 measured, so that one step disturbed by another
   job on the machine moves no median), and prints their sequences per second (the batch over
   rank 0's median step time, which includes waiting for the slowest rank).

Steps 2 and 3's runs are made `--rounds` times, one round after the other (ranks alone, auto,
uniform), and each configuration keeps its best round, the ideal too (each rank's best speed):
one run that another job on this shared machine slowed (auto measured 0.85 of ideal once
among 0.93–0.98) then moves no result.

The last line ends with auto / ideal (the issue's target: at least 0.9; uniform SPMD is held
to about 3 x the slowest rank's speed, near 0.75 of ideal at 1:1:2).
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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPT = os.path.join(ROOT, "examples", "gpt.py")
#: sequences per step: enough that every rank's fixed cost per step (the optimizer, launching ~1,000
#: kernels) is small beside its rows, as in real training
BATCH = 64
MODEL = ["--set", "model.layers=2", "--set", f"data.batch_size={BATCH}"]
HSPMD = os.path.join(os.path.dirname(sys.executable), "hspmd")


def hspmd(*args: str, timeout: int = 600) -> str:
    proc = subprocess.run([HSPMD, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"hspmd {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def median_step(log: str, skip: int = 4) -> float:
    times = [json.loads(line)["time_s"] for line in open(log) if line.startswith("{")]
    return statistics.median(times[skip:])


def planning_times() -> list[tuple[int, float]]:
    from hspmd.frontend.script import load_script, parse_overrides
    from hspmd.planner import Machine, model_facts, plan

    out = []
    for n in (8, 64, 512):  # a batch of 4 rows per 8 devices keeps them all busy (tp <= 4, pp <= 2)
        script = load_script(SCRIPT, parse_overrides(["model.layers=2", f"data.batch_size={max(16, n // 2)}"]))
        start = time.perf_counter()
        facts = model_facts(script, n)
        plan(facts, Machine.uniform(n, (1.0,) * (n // 2) + (2.0,) * (n - n // 2)))
        out.append((n, time.perf_counter() - start))
    return out


def rank_speeds(cores: list[int], steps: int, directory: str) -> list[float]:
    """Return each pinned rank's sequences per second, the three trained at once, alone each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs, logs = [], []
    for r, core in enumerate(cores):
        log = os.path.join(directory, f"alone-{r}.jsonl")
        logs.append(log)
        procs.append(subprocess.Popen(["taskset", "-c", str(core), HSPMD, "run", "-n", "1", SCRIPT, *MODEL,
                                       "--steps", str(steps), "--log", log], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode:
            raise SystemExit(f"a one-rank run failed: {err[-1000:]}")
    return [BATCH / median_step(log) for log in logs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24, help="steps per run (default 24; the first 4 dropped)")
    parser.add_argument("--cores", default="0,0,1", help="the core of each of the 3 ranks (default 0,0,1)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of runs; each configuration keeps its best (default 2)")
    args = parser.parse_args()
    cores = [int(c) for c in args.cores.split(",")]
    for n, seconds in planning_times():
        print(f"planning for {n} virtual devices (synthetic profile, two speeds): {seconds:.2f} s")
    directory = tempfile.mkdtemp(prefix="hspmd-planbench-")
    try:
        profile = os.path.join(directory, "profile.json")
        hspmd("profile", "-n", "3", "--cpu-bind", args.cores, "-o", profile)
        out = hspmd("plan", SCRIPT, *MODEL, "-n", "3", "--profile", profile).strip().splitlines()
        auto = out[-1].strip()
        print(f"planned: {auto}")
        runs = (("auto", "auto"), ("uniform [0-2]: dp=3", "[0-2]: dp=3"))
        speeds = [0.0] * len(cores)
        rates = {name: 0.0 for name, _ in runs}
        for r in range(max(1, args.rounds)):
            alone = rank_speeds(cores, args.steps, directory)
            speeds = [max(a, b) for a, b in zip(speeds, alone)]
            line = [f"round {r + 1}: alone " + ", ".join(f"{s:.0f}" for s in alone)]
            for name, strategy in runs:
                log = os.path.join(directory, "run.jsonl")
                hspmd("run", "-n", "3", SCRIPT, *MODEL, "--strategy", strategy, "--profile", profile,
                      "--cpu-bind", args.cores, "--steps", str(args.steps), "--log", log)
                rate = BATCH / median_step(log)
                rates[name] = max(rates[name], rate)
                line.append(f"{name} {rate:.0f}")
            print("; ".join(line) + " sequences/s")
        ideal = sum(speeds)
        print("rank speeds alone (--cpu-bind " + args.cores + ", best of the rounds): "
              + ", ".join(f"{s:.0f}" for s in speeds) + f" sequences/s; ideal (their sum) {ideal:.0f}")
        for name, _ in runs:
            print(f"{name}: {rates[name]:.0f} sequences/s ({rates[name] / ideal:.3f} of ideal)")
        print(f"auto {rates['auto']:.0f} sequences/s, uniform dp=3 {rates['uniform [0-2]: dp=3']:.0f}, "
              f"ideal {ideal:.0f}; auto / ideal {rates['auto'] / ideal:.3f}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
