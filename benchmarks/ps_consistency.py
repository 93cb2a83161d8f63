"""BSP, SSP:2 and ASP with a straggler: samples per second, and the AUC after the same wall time.

    python benchmarks/ps_consistency.py [--seconds 20] [--reps 2] [--bound 2]

Each run trains `examples/ctr.py` with `hspmd run -n 2 --servers 1 --cpu-bind 0,1,0` under
`[0,1]: dp=2 comm=ps consistency=C` for `--seconds` of wall time (workers stop starting steps
then). Worker 1 is pinned to core 1, which a busy process started by this benchmark shares
with it (so it runs at about half speed: a straggler); worker 0 and the server share core 0
(the server sleeps between messages). Samples/s counts every worker's rows of every step it
finished; the AUC is of held-out samples, from the servers' parameters at the end. The runs
alternate C = bsp, ssp:S, asp, `--reps` times, and medians are compared.

Under SSP and ASP a worker sends the pull of step t + 1 before it computes step t and leaves
its push in flight (docs/parameter-server.md, "Overlap"), which BSP cannot: its pull of t + 1
waits for every push of t. A line per model says where worker 0's step goes (waiting for its
pull, computing, pushing, meeting the other worker: BSP's all-reduce of the loss, where the fast
worker waits for the straggler; the rest: drawing the batch, the pull's request and copies).

What to expect: under BSP both workers go at the straggler's pace. SSP:S lets the fast worker
run up to S steps ahead, which absorbs the straggler's *jitter* (a time-shared core gives it
uneven slices) but not a steady 2x slowdown: in the long run the fast worker still waits. ASP
never waits, so its samples/s approach the sum of both workers' speeds.

The last line ends with the headline ratio: SSP:S samples/s ÷ BSP's (the issue's target: ≥ 1.3).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HSPMD = os.path.join(os.path.dirname(sys.executable), "hspmd")


def burn(core: int) -> None:
    """Spin on `core` forever (the straggler's neighbour)."""
    os.sched_setaffinity(0, {core})
    x = 0
    while True:
        x += 1


def run_to_end(cmd: list[str], timeout: float, env: dict | None = None) -> None:
    """Run `cmd` (with `env` added to the environment) in a session of its own; on a timeout or
    failure end all its processes (the ranks too)."""
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    try:
        if proc.wait(timeout):
            raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def run(consistency: str, seconds: float, cores: str, log: str) -> dict:
    """Return the end record (samples/s, AUC) of one wall-time-limited run under `consistency`
    ("ssp:S/no-overlap": SSP with the pull-ahead and the push in flight turned off)."""
    consistency, _, variant = consistency.partition("/")
    cmd = [HSPMD, "run", "-n", "2", "--servers", "1", os.path.join(ROOT, "examples", "ctr.py"),
           "--strategy", f"[0,1]: dp=2 comm=ps consistency={consistency}", "--steps", "1000000",
           "--seconds", str(seconds), "--cpu-bind", cores, "--log", log]
    run_to_end(cmd, seconds * 5 + 300, {"HSPMD_PS_OVERLAP": "0"} if variant == "no-overlap" else {})
    rows = [json.loads(line) for line in open(log)]
    end = next(r for r in rows if "samples_per_s" in r)
    steps = [r for r in rows if "staleness" in r]
    end["max_staleness"] = max(r["staleness"] for r in steps)
    # where worker 0's step goes: pull wait, compute, push, meeting the other worker, the rest
    for key in ("time_s", "wait_s", "compute_s", "push_s", "meet_s"):
        end["mean_" + key] = statistics.fmean(r[key] for r in steps) * 1e3
    return end


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--bound", type=int, default=2)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    fast, slow = cores[0], cores[-1]
    neighbour = multiprocessing.Process(target=burn, args=(slow,), daemon=True)
    neighbour.start()
    models = ("bsp", f"ssp:{args.bound}", "asp", f"ssp:{args.bound}/no-overlap")
    results: dict[str, list[dict]] = {m: [] for m in models}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.reps):
                for m in models:
                    end = run(m, args.seconds, f"{fast},{slow},{fast}", os.path.join(tmp, "log.jsonl"))
                    results[m].append(end)
                    print(f"rep {rep + 1} {m:17s}: {end['samples_per_s']:.0f} samples/s, AUC {end['auc']:.4f} "
                          f"after {end['wall_s']:.1f} s ({end['samples']} samples), max staleness {end['max_staleness']}",
                          flush=True)
    finally:
        neighbour.terminate()
        neighbour.join()
    med = {m: statistics.median(r["samples_per_s"] for r in rs) for m, rs in results.items()}
    auc = {m: statistics.median(r["auc"] for r in rs) for m, rs in results.items()}
    for m in models:
        last = results[m][-1]
        rest = last["mean_time_s"] - sum(last["mean_" + k] for k in ("wait_s", "compute_s", "push_s", "meet_s"))
        print(f"{m:17s}: worker 0's step {last['mean_time_s']:.1f} ms = pull wait {last['mean_wait_s']:.1f} + compute "
              f"{last['mean_compute_s']:.1f} + push {last['mean_push_s']:.1f} + meeting the other worker "
              f"{last['mean_meet_s']:.1f} + the rest {rest:.1f} ms (last repetition)")
    for m in models:
        print(f"{m:17s}: median {med[m]:.0f} samples/s ({med[m] / med['bsp']:.2f}x BSP), median AUC {auc[m]:.4f} "
              f"after {args.seconds:.0f} s")
    ssp = f"ssp:{args.bound}"
    plain = f"{ssp}/no-overlap"
    print(f"{ssp.upper()} without the overlap / BSP samples/s {med[plain] / med['bsp']:.3f}")
    print(f"ASP / BSP samples/s {med['asp'] / med['bsp']:.3f}; {ssp.upper()} / BSP samples/s "
          f"{med[ssp] / med['bsp']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
