"""Peak memory of a pipeline stage under GPipe and 1F1B, against the same step on one device.

    python benchmarks/pipeline_memory.py [--layers 4] [--batch 16] [--stages 2]

Compiles `examples/gpt.py` for one device and for `--stages` pipeline stages with m = 1, 2, 4,
8 micro-batches under each schedule, builds every rank's plan (the runtime lays out the
schedule's actions, then reuses buffers by liveness; nothing runs) and prints each stage's
peak bytes per step (`Plan.peak_bytes`: buffers, live arrays, parameters with optimizer
state, inputs) and its ratio to the one-device plan's peak. The peer is the one-device step:
a stage holds 1/stages of the parameters, and its activations depend on how many
micro-batches the schedule keeps in flight (GPipe all m, 1F1B at most stages - s).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def peaks(compiled) -> list[int]:
    """Return the peak bytes of the first rank of every device group of a compiled program."""
    from xdsl.dialects import func

    from hspmd.dialects.levels import physical_groups
    from hspmd.runtime.comm.inprocess import InProcessCommunicator
    from hspmd.runtime.plan import build_plan

    groups = physical_groups(compiled.physical)
    world = InProcessCommunicator.create_world(max(max(d) for d, _ in groups) + 1)
    out = []
    for devices, module in groups:
        step = next(f for f in module.body.block.ops if isinstance(f, func.FuncOp) and f.sym_name.data == "train_step")
        out.append(build_plan(step, devices[0], world[devices[0]], allocate=False).peak_bytes)
    return out


def main(argv: list[str] | None = None) -> int:
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script, parse_overrides

    parser = argparse.ArgumentParser(prog="python benchmarks/pipeline_memory.py")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args(argv)
    script = load_script(os.path.join(ROOT, "examples", "gpt.py"),
                         parse_overrides([f"model.layers={args.layers}", f"data.batch_size={args.batch}"]))
    (one,) = peaks(compile_script(script, "[0]: dp=1", 1))
    mib = 2.0 ** 20
    print(f"GPT, {args.layers} layers, batch {args.batch}: one device peaks at {one / mib:.1f} MiB per step")
    print(f"{'schedule':<9}{'m':>3}  " + "  ".join(f"{'stage ' + str(s) + ' MiB':>12}{'ratio':>7}"
                                                 for s in range(args.stages)))
    strategy = f"[0-{args.stages - 1}]: pp={args.stages}"
    for m in (1, 2, 4, 8):
        if args.batch % m:
            continue
        for schedule in ("gpipe", "1f1b"):
            stage_peaks = peaks(compile_script(script, strategy, args.stages, microbatches=m,
                                               pipeline_schedule=schedule))
            print(f"{schedule:<9}{m:>3}  " + "  ".join(f"{p / mib:>12.1f}{p / one:>7.2f}" for p in stage_peaks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
