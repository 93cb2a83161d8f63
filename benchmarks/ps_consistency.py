"""BSP, SSP:2 and ASP with stragglers, steady and bursty: samples per second, and the AUC after the same wall time.

    python benchmarks/ps_consistency.py [--seconds 20] [--reps 2] [--bound 2] [--straggler both|steady|bursty]

Each run trains `examples/ctr.py` with `hspmd run -n 2 --servers 1 --cpu-bind 0,1,0` under
`[0,1]: dp=2 comm=ps consistency=C` for `--seconds` of wall time (workers stop starting steps
then); worker 0 and the server share core 0 (the server sleeps between messages), worker 1 has
core 1. Two kinds of straggler:

* **steady**: a busy process started by this benchmark shares core 1 with worker 1, which runs
  at about half speed all the time;
* **bursty**: no busy process; each worker is slowed 3x in bursts of 1-2 steps, about a third
  of its steps, each from its own seeded schedule (`hspmd run --slow-bursts 3:SEED`,
  `hspmd/runtime/ps/bursts.py`: a slowed step's own work, all but the pull's wait, takes 3x as long).

Samples/s counts every worker's rows of every step it finished; the AUC is of held-out samples,
from the servers' parameters at the end. For each straggler the runs alternate C = bsp, ssp:S,
asp (and, steady, ssp:S without the overlap), `--reps` times, and medians are compared.

Under SSP and ASP a worker sends the pull of step t + 1 before it computes step t and leaves
its push in flight (docs/parameter-server.md, "Overlap"), which BSP cannot: its pull of t + 1
waits for every push of t. A line per model says where worker 0's step goes (waiting for its
pull, computing, pushing, meeting the other worker: BSP's all-reduce of the loss, where the fast
worker waits for the straggler; the rest: drawing the batch, the pull's request and copies).

What to expect: under BSP every step goes at the slower worker's pace. A steady straggler: SSP:S
lets the fast worker run up to S steps ahead, which absorbs jitter but not a steady slowdown; in
the long run the fast worker still waits, so SSP:S stays near BSP and only ASP gains. Bursty
stragglers: a burst of at most S steps is absorbed (the other worker runs ahead meanwhile and
the slowed one catches up after), so SSP:S approaches ASP (the targets: SSP:2 >= 1.2x BSP and
>= 0.9x ASP, AUC within 0.01 of BSP's).

The last line ends with the headline ratio: SSP:S samples/s / BSP's under bursty stragglers (with
`--straggler steady`: under the steady one).
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


#: `--slow-bursts`: each worker's slowed steps take 3x as long (the seed varies with the repetition)
BURST_FACTOR = 3


def run(consistency: str, seconds: float, cores: str, log: str, bursts: str | None = None) -> dict:
    """Return the end record (samples/s, AUC) of one wall-time-limited run under `consistency`
    ("ssp:S/no-overlap": SSP with the pull-ahead and the push in flight turned off); `bursts`:
    `--slow-bursts F:SEED`."""
    consistency, _, variant = consistency.partition("/")
    cmd = [HSPMD, "run", "-n", "2", "--servers", "1", os.path.join(ROOT, "examples", "ctr.py"),
           "--strategy", f"[0,1]: dp=2 comm=ps consistency={consistency}", "--steps", "1000000",
           "--seconds", str(seconds), "--cpu-bind", cores, "--log", log]
    if bursts:
        cmd += ["--slow-bursts", bursts]
    run_to_end(cmd, seconds * 5 + 300, {"HSPMD_PS_OVERLAP": "0"} if variant == "no-overlap" else {})
    rows = [json.loads(line) for line in open(log)]
    end = next(r for r in rows if "samples_per_s" in r)
    steps = [r for r in rows if "staleness" in r]
    end["max_staleness"] = max(r["staleness"] for r in steps)
    # where worker 0's step goes: pull wait, compute, push, meeting the other worker, the rest
    for key in ("time_s", "wait_s", "compute_s", "push_s", "meet_s"):
        end["mean_" + key] = statistics.fmean(r[key] for r in steps) * 1e3
    return end


def measure(straggler: str, models: tuple[str, ...], args, cores: list[int]) -> dict[str, list[dict]]:
    """Return each model's end records under `straggler` ("steady" or "bursty"), the models
    taking turns, `args.reps` times."""
    fast, slow = cores[0], cores[-1]
    neighbour = None
    if straggler == "steady":
        neighbour = multiprocessing.Process(target=burn, args=(slow,), daemon=True)
        neighbour.start()
    results: dict[str, list[dict]] = {m: [] for m in models}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.reps):
                for m in models:
                    bursts = f"{BURST_FACTOR}:{rep + 1}" if straggler == "bursty" else None
                    end = run(m, args.seconds, f"{fast},{slow},{fast}", os.path.join(tmp, "log.jsonl"), bursts)
                    results[m].append(end)
                    print(f"{straggler} rep {rep + 1} {m:17s}: {end['samples_per_s']:.0f} samples/s, AUC "
                          f"{end['auc']:.4f} after {end['wall_s']:.1f} s ({end['samples']} samples), max staleness "
                          f"{end['max_staleness']}", flush=True)
    finally:
        if neighbour is not None:
            neighbour.terminate()
            neighbour.join()
    return results


def summary(straggler: str, results: dict[str, list[dict]], seconds: float) -> dict[str, tuple[float, float]]:
    """Print where worker 0's step goes and each model's medians; return {model: (samples/s, AUC)}."""
    med = {m: statistics.median(r["samples_per_s"] for r in rs) for m, rs in results.items()}
    auc = {m: statistics.median(r["auc"] for r in rs) for m, rs in results.items()}
    for m, rs in results.items():
        last = rs[-1]
        rest = last["mean_time_s"] - sum(last["mean_" + k] for k in ("wait_s", "compute_s", "push_s", "meet_s"))
        print(f"{straggler} {m:17s}: worker 0's step {last['mean_time_s']:.1f} ms = pull wait {last['mean_wait_s']:.1f} "
              f"+ compute {last['mean_compute_s']:.1f} + push {last['mean_push_s']:.1f} + meeting the other worker "
              f"{last['mean_meet_s']:.1f} + the rest {rest:.1f} ms (last repetition)")
    for m in results:
        print(f"{straggler} {m:17s}: median {med[m]:.0f} samples/s ({med[m] / med['bsp']:.2f}x BSP), median AUC "
              f"{auc[m]:.4f} ({auc[m] - auc['bsp']:+.4f} against BSP) after {seconds:.0f} s")
    return {m: (med[m], auc[m]) for m in results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--bound", type=int, default=2)
    parser.add_argument("--straggler", choices=("both", "steady", "bursty"), default="both")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    ssp = f"ssp:{args.bound}"
    out: dict[str, dict[str, tuple[float, float]]] = {}
    if args.straggler in ("both", "steady"):
        steady = measure("steady", ("bsp", ssp, "asp", f"{ssp}/no-overlap"), args, cores)
        out["steady"] = summary("steady", steady, args.seconds)
        plain = out["steady"][f"{ssp}/no-overlap"][0] / out["steady"]["bsp"][0]
        print(f"steady: {ssp.upper()} without the overlap / BSP samples/s {plain:.3f}")
    if args.straggler in ("both", "bursty"):
        bursty = measure("bursty", ("bsp", ssp, "asp"), args, cores)
        out["bursty"] = summary("bursty", bursty, args.seconds)
    for straggler, r in out.items():
        print(f"{straggler}: ASP / BSP samples/s {r['asp'][0] / r['bsp'][0]:.3f}; {ssp.upper()} / ASP samples/s "
              f"{r[ssp][0] / r['asp'][0]:.3f}; {ssp.upper()} AUC - BSP AUC {r[ssp][1] - r['bsp'][1]:+.4f}; "
              f"{ssp.upper()} / BSP samples/s {r[ssp][0] / r['bsp'][0]:.3f}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
