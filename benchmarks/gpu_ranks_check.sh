#!/usr/bin/env bash
# Two ranks on one GPU (issue 28's done-when): `hspmd run -n 2 --device cuda` under dp, tp, pp
# (1F1B, 4 micro-batches), zero=1 and ep (examples/moe.py), and a GPU rank beside a CPU rank
# (`device=` per group), each against one CPU device: prints the largest loss difference per case.
# Part of `benchmarks/gpu_check.sh ranks` (which sets up the environment); usage: gpu_ranks_check.sh DIR
set -u
t=${1:-$(mktemp -d)}
hs() { python3 -m hspmd.cli.main "$@"; }
small="--set model.layers=2 --set model.d_model=64 --set model.seq_len=32 --set data.batch_size=8"
hs run -n 1 examples/gpt.py --device cpu --steps 3 --log "$t/ref-gpt.jsonl" $small >"$t/ref-gpt.out" 2>&1
hs run -n 1 examples/gpt.py --device cpu --steps 3 --log "$t/ref-pp.jsonl" $small --set microbatches=4 \
  --set pipeline_schedule=1f1b >"$t/ref-pp.out" 2>&1
hs run -n 1 examples/moe.py --device cpu --steps 3 --log "$t/ref-moe.jsonl" >"$t/ref-moe.out" 2>&1
check() {  # NAME REF SCRIPT STRATEGY DEVICE-ARGS EXTRA...
  local name=$1 ref=$2 script=$3 strategy=$4 device=$5; shift 5
  local t0=$(date +%s)
  hs run -n 2 "$script" --strategy "$strategy" $device --steps 3 --log "$t/$name.jsonl" "$@" >"$t/$name.out" 2>&1
  local rc=$?
  python3 - "$t/$ref.jsonl" "$t/$name.jsonl" "$name" "$rc" "$(( $(date +%s) - t0 ))" "$t/$name.out" <<'PY'
import json, sys
ref, got, name, rc, secs, out = sys.argv[1:]
try:
    a = [json.loads(l)["loss"] for l in open(ref)]
    b = [json.loads(l)["loss"] for l in open(got)]
    diff = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) == 3 else float("nan")
    print(f"{name}: exit {rc}, {secs} s, max loss difference {diff:.2e} over {len(b)} steps")
except (OSError, ValueError) as err:
    print(f"{name}: exit {rc}, {secs} s, no losses ({err}); {open(out).read()[-600:]}")
PY
}
check dp ref-gpt examples/gpt.py "[0,1]: dp=2" "--device cuda" $small
check tp ref-gpt examples/gpt.py "[0,1]: tp=2" "--device cuda" $small
check pp-1f1b ref-pp examples/gpt.py "[0,1]: pp=2" "--device cuda" $small --set microbatches=4 --set pipeline_schedule=1f1b
check zero1 ref-gpt examples/gpt.py "[0,1]: dp=2 zero=1" "--device cuda" $small
check ep ref-moe examples/moe.py "[0,1]: ep=2" "--device cuda"
check gpu+cpu ref-gpt examples/gpt.py "[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu share=1" "" $small
grep -h "^plan:" "$t/dp.out" | head -1
