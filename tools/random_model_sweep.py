"""The larger sweep of generated models (tests/models.py): many model-strategy pairs, every finding kept.

    python tools/random_model_sweep.py --models 200 [--strategies 4] [--seed S] [--kernels numpy|cpu]
    python tools/random_model_sweep.py --spec '{"kind": "encoder", ...}' --strategy '[0,1]: tp=2' -n 2

The first form draws `--models` models (hypothesis, seeded by `--seed`, else a random seed that it
prints), each trained on one device and under `--strategies` drawn strategies; it prints one line
per pair that failed (an internal error, a refusal that is not one line naming its reason, a
run that failed, losses that differ from one device's) with the command that runs it again,
then a summary: pairs trained, refused (by reason) and failed. The second form runs one pair
(the line a failure prints). Exit status 1 when any pair failed.

Each failure is reduced (`--reduce-dir DIR`, default `sweep-failures/`; `--no-reduce` skips it):
the pair's logical training step is written to `DIR/case-K/logical.mlir`, `hspmd compare` run on
it under the pair's strategy (an internal error, a failed run or different numbers: its exit
code), and, where that reproduces the failure, `hspmd reduce`'s engine shrinks the step while
`hspmd compare` still fails the same way (an internal error in the same pass): the smallest
program is `DIR/case-K/reduced.mlir`, and `DIR/case-K/again.sh` holds the commands that show the
failure on it and reduce again.

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


def compare_code(module, par: Parallel, kernels: str, passes=None) -> tuple[int, str]:
    """Return `hspmd compare`'s exit code on `module` (a logical step) under `par` (with `passes`, a
    PassManager, where given), and its line (an internal error's: the failing pass)."""
    from hspmd.cli.compare import compare_ir
    from hspmd.compiler import InternalError

    try:
        verdict = compare_ir(module, par.strategy, par.microbatches, par.schedule, kernels=kernels, passes=passes)
    except InternalError as err:
        return 3, err.pass_name
    except Exception as err:  # noqa: BLE001 - the user's kind of error: the step or the strategy refused
        return 1, f"{type(err).__name__}: {err}"
    return verdict.code, verdict.line


def reduce_failure(ref: Reference, par: Parallel, kernels: str, directory: str, passes=None) -> str:
    """Write the failing pair's logical step and its reduction under `directory` (see the module
    docstring); return one line saying what was written. `passes`: a PassManager the compiles run
    with (a test plants a bug through a user pass)."""
    from hspmd.cli.reduce import reduce_ir
    from hspmd.compiler import _record, _training_step, recompute_mode, stacks_layers
    from hspmd.dialects.context import module_text
    from models import _script

    os.makedirs(directory, exist_ok=True)
    case = os.path.join(directory, f"case-{len(os.listdir(directory))}")
    os.makedirs(case)
    script = _script(ref.spec, par.microbatches, par.schedule)
    record = _record(script, par.strategy, 0, par.n, None, None)
    logical, _ = _training_step(script, True, stacks_layers([record]), recompute_mode([record]))
    with open(os.path.join(case, "logical.mlir"), "w") as f:
        f.write(module_text(logical))
    code, what = compare_code(logical, par, kernels, passes)
    flags = f"--strategy '{par.strategy}' --microbatches {par.microbatches} --schedule {par.schedule} --kernels {kernels}"
    if code not in (3, 4, 5):
        return f"  {case}/logical.mlir: hspmd compare does not reproduce the failure on the step ({what}); not reduced"
    test = f"hspmd compare {{}} {flags}; test $? = {code}"
    def interesting(module, text: str) -> bool:
        got, line = compare_code(module, par, kernels, passes)
        return got == code and (code != 3 or line == what)  # an internal error: in the same pass

    result = reduce_ir(logical, interesting)
    with open(os.path.join(case, "reduced.mlir"), "w") as f:
        f.write(result.text)
    with open(os.path.join(case, "again.sh"), "w") as f:
        f.write(f"# {par}: {what}\nhspmd compare {case}/reduced.mlir {flags}\n"
                f"hspmd reduce {case}/logical.mlir --test \"{test}\" -o {case}/reduced.mlir\n")
    return (f"  reduced to {result.ops_after} ops (from {result.ops_before}, {result.tests} tests): "
            f"{case}/reduced.mlir; again: sh {case}/again.sh")


def sweep(models: int, strategies: int, kernels: str, run_seed: int, bundle: bool = False,
          reduce_dir: str | None = None) -> int:
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
                if reduce_dir:
                    print(reduce_failure(ref, par, kernels, reduce_dir), flush=True)
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
    p.add_argument("--reduce-dir", default="sweep-failures", metavar="DIR",
                   help="where each failure's step and its reduction go (DIR/case-K/)")
    p.add_argument("--no-reduce", action="store_true", help="do not reduce the failures")
    args = p.parse_args(argv)
    reduce_dir = None if args.no_reduce else args.reduce_dir
    if args.spec:
        ref = Reference(json.loads(args.spec))
        par = Parallel(args.strategy or "[0]: dp=1", args.n or 1, args.microbatches, args.schedule)
        try:
            out = check_pair(ref, par, args.kernels, args.bundle)
        except PairFailed as err:
            print(f"FAILED {err}")
            if reduce_dir:
                print(reduce_failure(ref, par, args.kernels, reduce_dir))
            return 1
        print(f"refused: {out.refused}" if out.refused else f"trained as on 1 device: {out.losses}")
        return 0
    run_seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {run_seed}", flush=True)
    return sweep(args.models, args.strategies, args.kernels, run_seed, args.bundle, reduce_dir)


if __name__ == "__main__":
    sys.exit(main())
