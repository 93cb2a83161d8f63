"""Variable-length sequences: length buckets, each its own program, against padding every batch to
the context; and per-bucket strategies against one strategy for every bucket.

    python benchmarks/varlen.py [--documents 200] [--strategy-documents 80] [--reps 2] [--skip-strategies]

The data is `examples/gpt_varlen.py`'s: real documents of very unequal length (the standard
library's docstrings and pydoc topics, a fixed sample, one sequence each, truncated to the
512-byte context), batched by a token budget of 4096 token slots (HetSeq's max_tokens). Both
sides run training steps of the same GPT (2 layers, d_model 64) on the same documents, one
epoch, with the plans, kernels (fused CPU) and switching `hspmd run` uses:

* **bucketed**: buckets 32, 64, 128, 256, 512; a batch holds `4096 // L` sequences of one bucket,
  padded to `L`; each bucket runs its own program compiled at `L` (five programs, compiled once,
  from one script; the run goes to the bucket's program at each step, parameters and optimizer
  states staying where they are, since the layouts agree);
* **padded**: one bucket of 512: every batch holds 8 sequences padded to 512.

Throughput is real (non-padding) tokens per second of step time. The machine is shared, so the
two sides alternate step by step and each epoch runs `--reps` times; a step counts its fastest
run (on 2 ranks, of the slower rank). Compile and plan building are not counted (printed: a
few seconds per program, once). The per-bucket strategies part (2 ranks in this process, threads):
buckets up to 128 data-parallel (`dp=2`), the longer ones tensor-parallel (`tp=2`), against
`dp=2` for every bucket.

The last line ends with the headline ratio: bucketed ÷ padded tokens per second (target ≥ 1.5).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hspmd.compiler import compile_strategies, write_bundle  # noqa: E402
from hspmd.frontend.script import load_script, parse_overrides  # noqa: E402
from hspmd.runtime.comm.inprocess import run_spmd  # noqa: E402
from hspmd.codegen.bundle import read_manifest  # noqa: E402
from hspmd.runtime.worker import load_rank_program, load_script_module, step_inputs, strategy_chooser  # noqa: E402
from hspmd.runtime.worker import switching_programs  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "gpt_varlen.py")
BUCKETS = [32, 64, 128, 256, 512]


def bundle(buckets: list[int], strategies: list[str], n: int, documents: int) -> tuple[str, dict, float]:
    """Return (bundle, config, compile s): the script compiled for each of `buckets`, bucket i under strategies[i]."""
    script = load_script(SCRIPT, parse_overrides([f"data.buckets={buckets}", f"data.documents={documents}"]))
    start = time.perf_counter()
    compiled = compile_strategies(script, strategies, n, configs=[{"data.bucket": b} for b in buckets])
    where = write_bundle(compiled, tempfile.mkdtemp(prefix="hspmd-varlen-"))
    return where, script.config, time.perf_counter() - start


def epoch(config: dict) -> list[dict]:
    """Return one epoch of the script's batches under `config`."""
    from hspmd.data.text import token_budget_batches

    module = load_script_module(SCRIPT)
    d = config["data"]
    return list(token_budget_batches(module.documents(config), d["max_tokens"], list(d["buckets"]), config["seed"], -100))


class Side:
    """One way of running the epoch on one rank: its programs, state, and step times."""

    def __init__(self, where: str, config: dict, comm) -> None:
        manifest = read_manifest(where)
        first = load_rank_program(where, manifest, comm, "cpu", True)
        self.programs, self.switcher = switching_programs(where, manifest, first, comm, "cpu", None)
        self.choose = strategy_chooser(manifest, list(range(len(self.programs))), None)
        self.state = first.plan.initial_state(0)
        self.current, self.comm, self.config = 0, comm, manifest.config  # with its lr schedule
        self.batches = epoch(config)

    def step(self, i: int) -> float:
        """Run batch i (switching programs first if it asks for another); return the seconds, switch included."""
        self.comm.barrier()
        start = time.perf_counter()
        batch = self.batches[i]
        index = self.choose(i + 1, batch)
        if index != self.current:
            self.state, _ = self.switcher.switch(self.state, self.current, index)
            self.current = index
        plan = self.programs[index].plan
        plan.run(self.state, plan.local_batch({**batch, **step_inputs(i + 1, self.config, {"lr": 0})}))
        return time.perf_counter() - start


def compare(a: tuple[str, dict], b: tuple[str, dict], n: int, reps: int) -> tuple[float, float, int, int, int]:
    """Return (tokens/s of a, of b, real tokens, steps of a, of b): both epochs run `reps` times,
    alternating step by step, each step's time the least of its runs (of the slowest rank)."""
    def rank(comm):
        sides = [Side(*a, comm), Side(*b, comm)]
        times = [[float("inf")] * len(s.batches) for s in sides]
        for _ in range(reps):
            for i in range(max(len(s.batches) for s in sides)):
                for s, t in zip(sides, times):
                    if i < len(s.batches):
                        t[i] = min(t[i], s.step(i))
        return times, [s.batches for s in sides]

    results = run_spmd(n, rank, timeout=3600)
    totals = [sum(max(r[0][k][i] for r in results) for i in range(len(results[0][0][k]))) for k in range(2)]
    tokens = [sum(int((x["targets"] != -100).sum()) for x in batches) for batches in results[0][1]]
    assert tokens[0] == tokens[1], tokens  # the same documents: every real token once per epoch
    return tokens[0] / totals[0], tokens[1] / totals[1], tokens[0], len(results[0][0][0]), len(results[0][0][1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=200, help="documents sampled (default 200)")
    parser.add_argument("--strategy-documents", type=int, default=80,
                        help="documents of the 2-rank per-bucket strategies part (default 80)")
    parser.add_argument("--reps", type=int, default=2, help="runs of each epoch; a step counts its fastest (default 2)")
    parser.add_argument("--skip-strategies", action="store_true", help="only the bucketed vs padded part")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    if not args.skip_strategies:
        split = [("[0,1]: dp=2" if b <= 128 else "[0,1]: tp=2") for b in BUCKETS]
        mixed, _, _ = bundle(BUCKETS, split, 2, args.strategy_documents)
        single, config, _ = bundle(BUCKETS, ["[0,1]: dp=2"] * len(BUCKETS), 2, args.strategy_documents)
        m, s1, tokens, steps, _ = compare((mixed, config), (single, config), 2, args.reps)
        print(f"2 ranks, {steps} steps, {tokens} real tokens: per-bucket strategies (dp=2 up to 128, tp=2 above, "
              f"switches included) {m:.0f} tokens/s, dp=2 for every bucket {s1:.0f} tokens/s; "
              f"per-bucket / single {m / s1:.3f}", flush=True)
    bucketed, config_b, compile_b = bundle(BUCKETS, ["[0]: dp=1"] * len(BUCKETS), 1, args.documents)
    padded, config_p, compile_p = bundle([BUCKETS[-1]], ["[0]: dp=1"], 1, args.documents)
    b, p, tokens, steps_b, steps_p = compare((bucketed, config_b), (padded, config_p), 1, args.reps)
    print(f"1 rank, {tokens} real tokens: bucketed {steps_b} steps, {b:.0f} tokens/s ({len(BUCKETS)} programs, "
          f"compiled in {compile_b:.1f} s); padded to {BUCKETS[-1]} {steps_p} steps, {p:.0f} tokens/s (compiled in "
          f"{compile_p:.1f} s); bucketed / padded {b / p:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
