"""Snapshot what the compiler emits and what training logs, to show a refactoring changed nothing.

    python tools/ir_snapshot.py take DIR [--quick]     # compile and train every configuration
    python tools/ir_snapshot.py compare OLD NEW        # byte-compare two snapshots

`take` compiles each configuration of `CONFIGS` with `hspmd compile --dump-dir --emit kernels`
(logical, annotated, physical and kernel IR, the kernels' `.cu` files) and `--report`, and runs
each configuration of `RUNS` for a few steps with `--log`, keeping the losses as text (their
`repr`, so equal text means equal bits). `compare` lists every file that differs, is missing
or is new, and exits 1 if any does. Run `take` on the commit before a change and on the one
after it; `--quick` keeps a third of the configurations for a first look.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"
GPT_SMALL = ("model.layers=2", "model.d_model=32", "model.seq_len=16", "data.batch_size=8")
DROPOUT = (*GPT_SMALL, "model.dropout=0.1")

#: (name, script, strategy, --set overrides): compiled, IR and reports kept
CONFIGS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("gpt-1", "gpt.py", "[0]: dp=1", ()),
    ("gpt-dp2", "gpt.py", "[0,1]: dp=2", ()),
    ("gpt-tp2", "gpt.py", "[0,1]: tp=2", ()),
    ("gpt-pp2", "gpt.py", "[0,1]: pp=2", ("microbatches=4", "pipeline_schedule=1f1b")),
    ("gpt-dp2tp2", "gpt.py", "[0-3]: dp=2 tp=2", ()),
    ("gpt-tp2sp", "gpt.py", "[0,1]: tp=2 sp=1", ()),
    ("gpt-hetero-dp", "gpt.py", "[0,1]: dp=2 share=3 | [2]: dp=1 share=1", ()),
    ("gpt-hetero-tp", "gpt.py", "[0,1]: tp=2 share=2 | [2]: tp=1 share=1", ()),
    ("gpt-hier-tp", "gpt.py", "[0,1]: tp=2 share=3 | [2,3]: tp=2 share=1", ()),
    ("gpt-zero2", "gpt.py", "[0-3]: dp=4 zero=2", ()),
    ("gpt-pp-zero1", "gpt.py", "[0-3]: dp=2 pp=2 zero=1", ("microbatches=2",)),
    ("gpt-zero1-groups", "gpt.py", "[0,1]: dp=2 zero=1 | [2,3]: dp=2 zero=1", ()),
    ("gpt-pp-beside", "gpt.py", "[0,1]: pp=2 share=1 | [2]: dp=1 share=1", ("microbatches=2",)),
    ("gpt-small-dropout-tp2", "gpt.py", "[0,1]: tp=2", DROPOUT),
    ("gpt-bf16-dp2", "gpt.py", "[0,1]: dp=2", (*GPT_SMALL, "precision=bfloat16")),
    ("gpt-48-dp2", "gpt.py", "[0,1]: dp=2", ("model.layers=48",)),
    ("mlp-dp2", "mlp.py", "[0,1]: dp=2", ()),
    ("mlp-tp2", "mlp.py", "[0,1]: tp=2", ()),
    ("llama-tp2", "llama.py", "[0,1]: tp=2", ()),
    ("llama-dp2pp2", "llama.py", "[0-3]: dp=2 pp=2", ("microbatches=2",)),
    ("moe-ep2", "moe.py", "[0,1]: ep=2", ()),
    ("moe-dp2", "moe.py", "[0,1]: dp=2", ()),
    ("varlen-dp2", "gpt_varlen.py", "[0,1]: dp=2", ()),
]

#: (name, ranks, script, strategy, --set overrides): trained for STEPS steps, losses kept
RUNS: list[tuple[str, int, str, str, tuple[str, ...]]] = [
    ("gpt-1", 1, "gpt.py", "[0]: dp=1", GPT_SMALL),
    ("gpt-dp2", 2, "gpt.py", "[0,1]: dp=2", GPT_SMALL),
    ("gpt-tp2", 2, "gpt.py", "[0,1]: tp=2", GPT_SMALL),
    ("gpt-pp2", 2, "gpt.py", "[0,1]: pp=2", GPT_SMALL),
    ("gpt-dp2tp2", 4, "gpt.py", "[0-3]: dp=2 tp=2", GPT_SMALL),
    ("gpt-hetero-dp", 3, "gpt.py", "[0,1]: dp=2 share=3 | [2]: dp=1 share=1", GPT_SMALL),
    ("gpt-hetero-tp", 3, "gpt.py", "[0,1]: tp=2 share=2 | [2]: tp=1 share=1", GPT_SMALL),
    ("gpt-hier-tp", 4, "gpt.py", "[0,1]: tp=2 share=3 | [2,3]: tp=2 share=1", GPT_SMALL),
    ("gpt-zero2", 4, "gpt.py", "[0-3]: dp=4 zero=2", GPT_SMALL),
    ("gpt-pp-zero1", 4, "gpt.py", "[0-3]: dp=2 pp=2 zero=1", GPT_SMALL),
    ("gpt-zero1-groups", 4, "gpt.py", "[0,1]: dp=2 zero=1 | [2,3]: dp=2 zero=1", GPT_SMALL),
    ("gpt-dropout-tp2", 2, "gpt.py", "[0,1]: tp=2", DROPOUT),
    ("gpt-dropout-pp2", 2, "gpt.py", "[0,1]: pp=2", (*DROPOUT, "microbatches=2", "pipeline_schedule=1f1b")),
    ("gpt-bf16-dp2", 2, "gpt.py", "[0,1]: dp=2", (*GPT_SMALL, "precision=bfloat16")),
    ("gpt-numpy-1", 1, "gpt.py", "[0]: dp=1", (*GPT_SMALL,)),
    ("mlp-dp2", 2, "mlp.py", "[0,1]: dp=2", ()),
    ("llama-tp2", 2, "llama.py", "[0,1]: tp=2", ("model.layers=2", "model.d_model=32", "model.seq_len=16")),
    ("moe-ep2", 2, "moe.py", "[0,1]: ep=2", ()),
]
STEPS = 12
QUICK = 3  # --quick keeps every QUICK-th configuration


def _sets(overrides) -> list[str]:
    return [a for kv in overrides for a in ("--set", kv)]


def _run(args: list[str], out: Path | None = None, timeout: int = 900) -> str:
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(args)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    if out is not None:
        out.write_text(proc.stdout)
    return proc.stdout


def take(dest: Path, quick: bool) -> None:
    """Compile every configuration and train every run into `dest`."""
    if dest.exists():
        shutil.rmtree(dest)
    configs = CONFIGS[::QUICK] if quick else CONFIGS
    runs = RUNS[::QUICK] if quick else RUNS
    for name, script, strategy, overrides in configs:
        t = time.perf_counter()
        d = dest / "ir" / name
        _run(["hspmd", "compile", str(EX / script), "--strategy", strategy, *_sets(overrides),
              "--dump-dir", str(d), "--emit", "kernels"])
        _run(["hspmd", "compile", str(EX / script), "--strategy", strategy, *_sets(overrides), "--report"],
             d / "report.txt")
        for f in d.rglob("*"):  # the checkout's path (the manifest names the script) is not compared
            if f.is_file() and str(ROOT) in (text := f.read_text()):
                f.write_text(text.replace(str(ROOT), "<root>"))
        print(f"compiled {name} in {time.perf_counter() - t:.1f} s", flush=True)
    for name, n, script, strategy, overrides in runs:
        t = time.perf_counter()
        log = dest / "losses" / f"{name}.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        kernels = ["--kernels", "numpy"] if "numpy" in name else []
        _run(["hspmd", "run", "-n", str(n), str(EX / script), "--strategy", strategy, "--steps", str(STEPS),
              "--log", str(log), *kernels, *_sets(overrides)])
        losses = [repr(json.loads(line)["loss"]) for line in log.read_text().splitlines()]
        (dest / "losses" / f"{name}.txt").write_text("\n".join(losses) + "\n")
        log.unlink()
        print(f"trained {name} in {time.perf_counter() - t:.1f} s: last loss {losses[-1]}", flush=True)


def compare(old: Path, new: Path) -> int:
    """Print what differs between two snapshots; return the number of differing files."""
    names = {p.relative_to(old) for p in old.rglob("*") if p.is_file()}
    names |= {p.relative_to(new) for p in new.rglob("*") if p.is_file()}
    bad = 0
    for rel in sorted(names):
        a, b = old / rel, new / rel
        if not a.exists() or not b.exists():
            print(f"{'only in ' + str(new) if not a.exists() else 'only in ' + str(old)}: {rel}")
            bad += 1
        elif not filecmp.cmp(a, b, shallow=False):
            print(f"differs: {rel}")
            bad += 1
    print(f"{len(names)} files, {bad} differ")
    return bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("take")
    t.add_argument("dest", type=Path)
    t.add_argument("--quick", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.cmd == "take":
        os.environ.setdefault("PYTHONHASHSEED", "0")
        take(args.dest, args.quick)
    else:
        sys.exit(1 if compare(args.old, args.new) else 0)


if __name__ == "__main__":
    main()
