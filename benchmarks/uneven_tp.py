"""Tensor parallelism over a head count tp does not divide, against the even split and one rank.

    python benchmarks/uneven_tp.py [--steps 12] [--d-model 96] [--layers 2]

GPT (examples/gpt.py) with d_model `--d-model`, trained over MPI (`hspmd run ... --log`), each
run in its own processes, one after the other:

* **uneven**: 3 heads under `[0,1]: tp=2`: rank 0 holds 2 heads, rank 1 one (uneven pieces,
  docs/layouts.md); the MLP is split evenly;
* **even**: 4 heads under `[0,1]: tp=2` (2 heads each), the same d_model, so the same FLOPs and
  the same collectives (4 heads of d/4 against 3 of d/3);
* **one rank**: 3 heads on `[0]: dp=1`.

Each run's step time is the median of its logged `time_s` after two warm-up steps. The losses of
uneven and one rank are compared (they must agree; the line says the largest difference). The
planner's price of the imbalance (`ModelFacts.tp_busiest(2)`: the busiest rank's share of the
tp-split weights over an even half) is printed beside the measurement.

The last line ends with the headline ratio: uneven step time ÷ even step time (1.0 would mean the
uneven split costs nothing; the busiest rank's extra head bounds it near tp_busiest).
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
sys.path.insert(0, ROOT)

from hspmd.frontend.script import load_script, parse_overrides  # noqa: E402
from hspmd.planner import model_facts  # noqa: E402

GPT = os.path.join(ROOT, "examples", "gpt.py")
HSPMD = os.path.join(os.path.dirname(sys.executable), "hspmd")


def run(n: int, strategy: str, sets: list[str], steps: int, log: str) -> list[dict]:
    """Run GPT on `n` ranks under `strategy`; return its log records."""
    args = [HSPMD, "run", "-n", str(n), GPT, "--strategy", strategy, "--steps", str(steps), "--log", log]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{strategy} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in open(log)]


def step_s(records: list[dict]) -> float:
    return statistics.median(r["time_s"] for r in records[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    base = [f"model.d_model={args.d_model}", f"model.layers={args.layers}", "model.seq_len=64",
            "data.batch_size=8", "optim.warmup=2"]
    three, four = base + ["model.heads=3"], base + ["model.heads=4"]
    facts = model_facts(load_script(GPT, parse_overrides(three)), 2)
    with tempfile.TemporaryDirectory() as tmp:
        uneven = run(2, "[0,1]: tp=2", three, args.steps, os.path.join(tmp, "uneven.jsonl"))
        even = run(2, "[0,1]: tp=2", four, args.steps, os.path.join(tmp, "even.jsonl"))
        one = run(1, "[0]: dp=1", three, args.steps, os.path.join(tmp, "one.jsonl"))
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(uneven, one))
    print(f"GPT d_model={args.d_model}, {args.layers} layers, batch 8 x 64, {args.steps} steps, 2 MPI ranks")
    print(f"uneven losses equal one rank's: largest difference {diff:.2e} over {len(one)} steps")
    print(f"one rank (3 heads, [0]: dp=1):      {1e3 * step_s(one):8.1f} ms/step")
    print(f"even tp (4 heads, [0,1]: tp=2):     {1e3 * step_s(even):8.1f} ms/step")
    print(f"uneven tp (3 heads, [0,1]: tp=2):   {1e3 * step_s(uneven):8.1f} ms/step  (2 heads and 1)")
    print(f"planner's price of the imbalance (tp_busiest): {facts.tp_busiest(2):.3f}")
    print(f"uneven / one rank: {step_s(uneven) / step_s(one):.3f}")
    print(f"uneven / even step time: {step_s(uneven) / step_s(even):.3f}")


if __name__ == "__main__":
    main()
