"""The larger sweep of generated models (tests/models.py): many model-strategy pairs, every finding kept.

    python tools/random_model_sweep.py --models 200 [--strategies 4] [--seed S] [--kernels numpy|cpu]
    python tools/random_model_sweep.py --spec '{"kind": "encoder", ...}' --strategy '[0,1]: tp=2' -n 2

The first form draws `--models` models (hypothesis, seeded by `--seed`, else a random seed that it
prints), each trained on one device and under `--strategies` drawn strategies; it prints one line
per pair that failed (an internal error, a refusal that is not one line naming its reason, a
run that failed, losses that differ from one device's) with the command that runs it again,
then a summary: pairs trained, refused (by reason) and failed. The second form runs one pair
(the line a failure prints). Exit status 1 when any pair failed.

The CI sweep is `tests/test_random_models.py` (a bounded number of pairs on every run).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from models import Parallel, PairFailed, Reference, check_pair, model_specs, parallel_strategies  # noqa: E402


def reason_of(message: str) -> str:
    """Return a refusal's message with its numbers and names taken out: what kind of refusal it is."""
    text = re.sub(r"'[^']*'", "'…'", message)
    text = re.sub(r"\[[^\]]*\]", "[…]", text)
    return re.sub(r"\d+", "N", text)[:160]


def sweep(models: int, strategies: int, kernels: str, run_seed: int, bundle: bool = False) -> int:
    counts = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    failures: list[str] = []
    start = time.perf_counter()

    @seed(run_seed)
    @settings(max_examples=models, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one_model(data):
        spec = data.draw(model_specs())
        ref = Reference(spec)
        for _ in range(strategies):
            par = data.draw(parallel_strategies(spec))
            try:
                out = check_pair(ref, par, kernels, bundle)
            except PairFailed as err:
                counts["failed"] += 1
                failures.append(str(err))
                print(f"FAILED {err}", flush=True)
                continue
            if out.refused is not None:
                counts["refused"] += 1
                reasons[reason_of(out.refused)] += 1
            else:
                counts["trained"] += 1

    one_model()
    pairs = sum(counts.values())
    print(f"\nseed {run_seed}: {models} models, {pairs} model-strategy pairs in {time.perf_counter() - start:.0f} s: "
          f"{counts['trained']} trained as on 1 device, {counts['refused']} refused by the strategy checks, "
          f"{counts['failed']} failed")
    for reason, k in reasons.most_common():
        print(f"  refused {k:4d}x  {reason}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=50)
    p.add_argument("--strategies", type=int, default=4, help="strategies drawn per model")
    p.add_argument("--seed", type=int, help="the hypothesis seed (default: a random one, printed)")
    p.add_argument("--kernels", choices=("numpy", "cpu"), default="numpy")
    p.add_argument("--bundle", action="store_true",
                   help="train each pair through a written bundle, as hspmd run does (slower)")
    p.add_argument("--spec", help="run one pair: the model's spec (JSON, as a failure prints it)")
    p.add_argument("--strategy", help="with --spec: the strategy")
    p.add_argument("-n", type=int, help="with --spec: the devices")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--schedule", default="gpipe")
    args = p.parse_args(argv)
    if args.spec:
        ref = Reference(json.loads(args.spec))
        par = Parallel(args.strategy or "[0]: dp=1", args.n or 1, args.microbatches, args.schedule)
        try:
            out = check_pair(ref, par, args.kernels, args.bundle)
        except PairFailed as err:
            print(f"FAILED {err}")
            return 1
        print(f"refused: {out.refused}" if out.refused else f"trained as on 1 device: {out.losses}")
        return 0
    run_seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {run_seed}", flush=True)
    return sweep(args.models, args.strategies, args.kernels, run_seed, args.bundle)


if __name__ == "__main__":
    sys.exit(main())
