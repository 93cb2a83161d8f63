"""The HET cache: bytes a worker moves to and from the servers per step, with the cache and without.

    python benchmarks/het_cache.py [--steps 100] [--warmup 20] [--rows 200000] [--bound 16]

Both runs train `examples/ctr.py` (26 Zipf-distributed fields, 1.0e6 rows per table) with
`hspmd run -n 2 --servers 1` under `[0,1]: dp=2 comm=hybrid consistency=ssp:2` — the tables
through the server, the dense layers by all-reduce — the second with `cache=ROWS:B` (each
worker keeps ROWS rows per table, each used for B steps after its pull). A worker's bytes are
what it pulls (ids asked for, rows received) and pushes (ids and gradient rows), rank 0's
`bytes` log field; the mean over the steps after `--warmup` is compared (the cache starts
empty). The hit rate is the share of the distinct rows a step looks up that the cache gave.
Both runs end with the held-out AUC, to show the cache did not cost the model.

The last line ends with the headline ratio: bytes per step with the cache ÷ without (the
issue's target: ≤ 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from ps_consistency import run_to_end  # beside this file: the same way to run a job to its end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HSPMD = os.path.join(os.path.dirname(sys.executable), "hspmd")


def run(strategy: str, steps: int, log: str) -> list[dict]:
    """Return the log lines of one `hspmd run` of the CTR example under `strategy`."""
    cmd = [HSPMD, "run", "-n", "2", "--servers", "1", os.path.join(ROOT, "examples", "ctr.py"),
           "--strategy", strategy, "--steps", str(steps), "--log", log]
    run_to_end(cmd, 1800)
    return [json.loads(line) for line in open(log)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--bound", type=int, default=16)
    args = parser.parse_args()
    base = "[0,1]: dp=2 comm=hybrid consistency=ssp:2"
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, strategy in (("no cache", base), ("cache", f"{base} cache={args.rows}:{args.bound}")):
            rows = run(strategy, args.steps, os.path.join(tmp, "log.jsonl"))
            steps = [r for r in rows if "bytes" in r and r["step"] > args.warmup]
            per_step = sum(r["bytes"] for r in steps) / len(steps)
            auc = next((r["auc"] for r in rows if "auc" in r), float("nan"))
            hit = steps[-1].get("cache_hit_rate")
            out[name] = per_step
            print(f"{name:9s} '{strategy}': {per_step / 1024:.1f} KiB per step (steps {args.warmup + 1}-{args.steps}), "
                  f"AUC {auc:.4f}" + (f", hit rate {hit:.3f}" if hit is not None else ""), flush=True)
    print(f"bytes per step with the cache / without ({args.rows} rows, bound {args.bound}): "
          f"{out['cache'] / out['no cache']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
