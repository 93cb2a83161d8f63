"""A rank killed with kill -9 under `--redundancy peer`: steps redone, restart time, losses, overhead.

    python benchmarks/peer_recovery.py [--seed S] [--steps 40] [--overhead-steps 120] [--reps 2]

GPT with 2 layers on 3 ranks under `[0-2]: dp=3 zero=1` (the optimizer states sharded, so the
copies must cross ranks), `hspmd run --elastic --redundancy peer`:

1. **Recovery.** Rank 1 is killed (`HSPMD_FAULT=1:K`, SIGKILL at the start of step K, K drawn
   from `--seed`) in a run of `--steps` steps; from the run's `--log`, its restart line:
   `steps_redone` (target <= 1) and `restart_s`, from the last step logged before the kill to the
   end of the first step after (target <= 2 s).
2. **Losses.** The same run switched by hand: 3 ranks up to the step the restart resumed from,
   a checkpoint there, then the fallback strategy on 2 ranks from it. Every step's loss of the
   recovered run (the last of a step logged twice) against it: max relative difference (target
   <= 1e-5).
3. **Overhead.** The run without a fault, with and without `--redundancy peer`, alternately
   (`--reps` of each): each step's time in the plan plus the training thread's time in the copies
   (`copy_s`), median over the second half of `--overhead-steps` steps (after the standby ranks,
   started beside the run for the next restart, are ready). The headline, last: peer / none
   (target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["examples/gpt.py", "--set", "model.layers=2", "--set", "data.batch_size=12"]
STRATEGY = "[0-2]: dp=3 zero=1"


def hspmd(args: list[str], env: dict | None = None) -> None:
    """Run `hspmd ARGS` from the project root; raise with its output if it fails."""
    exe = os.path.join(os.path.dirname(sys.executable), "hspmd")
    cmd = [exe] if os.path.isfile(exe) else [sys.executable, "-m", "hspmd.cli.main"]
    proc = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env={**{k: v for k, v in os.environ.items() if k != "HSPMD_FAULT"}, **(env or {})},
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"hspmd {' '.join(args[:3])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def losses(path: str) -> dict[int, float]:
    """Return step -> loss of a --log (a step logged twice: its last line)."""
    return {r["step"]: r["loss"] for r in rows(path) if "step" in r and "event" not in r}


def recovery(tmp: str, steps: int, kill_at: int) -> tuple[dict, dict[int, float]]:
    log = os.path.join(tmp, "kill.jsonl")
    hspmd(["run", "-n", "3", *MODEL, "--steps", str(steps), "--strategy", STRATEGY, "--elastic", "--redundancy",
           "peer", "--checkpoint-dir", os.path.join(tmp, "ck-kill"), "--log", log], {"HSPMD_FAULT": f"1:{kill_at}"})
    restarts = [r for r in rows(log) if r.get("event") == "restart"]
    if len(restarts) != 1:
        raise SystemExit(f"{len(restarts)} restart lines in {log}, want 1")
    return restarts[0], losses(log)


def by_hand(tmp: str, steps: int, at: int) -> dict[int, float]:
    """Return the losses of 3 ranks to step `at`, then 2 ranks (dp=2, the fallback) from there."""
    a, b, ck = os.path.join(tmp, "a.jsonl"), os.path.join(tmp, "b.jsonl"), os.path.join(tmp, "ck-hand")
    hspmd(["run", "-n", "3", *MODEL, "--steps", str(at), "--strategy", STRATEGY, "--checkpoint-dir", ck,
           "--checkpoint-every", str(at), "--log", a])
    hspmd(["run", "-n", "2", *MODEL, "--steps", str(steps), "--strategy", "[0,1]: dp=2", "--resume", ck, "--log", b])
    return {**losses(a), **losses(b)}


def step_times(tmp: str, steps: int, peer: bool, rep: int) -> list[float]:
    log = os.path.join(tmp, f"{'peer' if peer else 'none'}-{rep}.jsonl")
    hspmd(["run", "-n", "3", *MODEL, "--steps", str(steps), "--strategy", STRATEGY, "--elastic",
           *(["--redundancy", "peer"] if peer else []), "--checkpoint-dir", os.path.join(tmp, f"ck-{rep}-{peer}"),
           "--checkpoint-every", str(10 * steps), "--log", log])
    return [r["time_s"] + r.get("copy_s", 0.0) for r in rows(log) if "step" in r and r["step"] > steps // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, help="draws the step rank 1 is killed at (default: random)")
    parser.add_argument("--steps", type=int, default=40, help="steps of the recovery run (default 40)")
    parser.add_argument("--overhead-steps", type=int, default=120, help="steps of each overhead run (default 120)")
    parser.add_argument("--reps", type=int, default=2, help="overhead runs with and without copies (default 2)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    kill_at = random.Random(seed).randint(6, args.steps - 5)
    tmp = tempfile.mkdtemp(prefix="peer-recovery-")
    start = time.monotonic()
    record, got = recovery(tmp, args.steps, kill_at)
    print(f"rank 1 killed at step {kill_at} (seed {seed}): resumed from step {record['resumed_from_step']} "
          f"({record['source']}), {record['steps_redone']} step(s) redone (target <= 1), restart "
          f"{record['restart_s']:.3f} s (target <= 2 s)", flush=True)
    want = by_hand(tmp, args.steps, int(record["resumed_from_step"]))
    common = sorted(set(got) & set(want))
    worst = max(abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in common)
    print(f"losses against 3 ranks to step {record['resumed_from_step']}, then 2 by hand: max relative difference "
          f"{worst:.2e} over {len(common)} steps (target <= 1e-5)", flush=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.reps):
        for peer in (rep % 2 == 0, rep % 2 == 1):  # alternate which goes first
            times[peer] += step_times(tmp, args.overhead_steps, peer, rep)
    peer, none = statistics.median(times[True]), statistics.median(times[False])
    print(f"({time.monotonic() - start:.0f} s in all; load {os.getloadavg()[0]:.1f})")
    print(f"step with peer copies {peer * 1e3:.2f} ms, without {none * 1e3:.2f} ms (median of the second halves of "
          f"{args.reps} runs each, alternating); overhead of --redundancy peer: {peer / none:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
