#!/usr/bin/env bash
# Two ranks on one GPU (issue 28's done-when): `hspmd run -n 2 --device cuda` under dp, tp, pp
# (1F1B, 4 micro-batches), zero=1 and ep (examples/moe.py), and a GPU rank beside a CPU rank
# (`device=` per group), each against one CPU device: prints the largest loss difference per case
# and whether it is within 1e-4 of the loss. The 9 runs (3 one-device references, 6 cases) go at
# once (16 cores, one GPU: they check numbers, not times), each bounded by RUN_TIMEOUT seconds, so
# the whole takes about the slowest run.
# Part of `benchmarks/gpu_check.sh ranks` (which sets up the environment); usage: gpu_ranks_check.sh DIR
set -u
t=${1:-$(mktemp -d)}
run_timeout=${RUN_TIMEOUT:-80}
hs() { timeout -k 5 "$run_timeout" python3 -m hspmd.cli.main "$@"; }
small="--set model.layers=2 --set model.d_model=64 --set model.seq_len=32 --set data.batch_size=8"
start=$(date +%s)
hs run -n 1 examples/gpt.py --device cpu --steps 3 --log "$t/ref-gpt.jsonl" $small >"$t/ref-gpt.out" 2>&1 &
hs run -n 1 examples/gpt.py --device cpu --steps 3 --log "$t/ref-pp.jsonl" $small --set microbatches=4 \
  --set pipeline_schedule=1f1b >"$t/ref-pp.out" 2>&1 &
hs run -n 1 examples/moe.py --device cpu --steps 3 --log "$t/ref-moe.jsonl" >"$t/ref-moe.out" 2>&1 &
launch() {  # NAME SCRIPT STRATEGY DEVICE-ARGS EXTRA...: the run in the background, its exit status in NAME.rc
  local name=$1 script=$2 strategy=$3 device=$4; shift 4
  ( t0=$(date +%s)
    hs run -n 2 "$script" --strategy "$strategy" $device --steps 3 --log "$t/$name.jsonl" "$@" >"$t/$name.out" 2>&1
    echo "$? $(( $(date +%s) - t0 ))" >"$t/$name.rc" ) &
}
launch dp examples/gpt.py "[0,1]: dp=2" "--device cuda" $small
launch tp examples/gpt.py "[0,1]: tp=2" "--device cuda" $small
launch pp-1f1b examples/gpt.py "[0,1]: pp=2" "--device cuda" $small --set microbatches=4 --set pipeline_schedule=1f1b
launch zero1 examples/gpt.py "[0,1]: dp=2 zero=1" "--device cuda" $small
launch ep examples/moe.py "[0,1]: ep=2" "--device cuda"
launch gpu+cpu examples/gpt.py "[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu share=1" "" $small
sleep 20; timeout 5 nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | head -16
wait
python3 - "$t" <<'PY'
import json, sys
t = sys.argv[1]
cases = {"dp": "ref-gpt", "tp": "ref-gpt", "pp-1f1b": "ref-pp", "zero1": "ref-gpt", "ep": "ref-moe", "gpu+cpu": "ref-gpt"}
ok = 0
for name, ref in cases.items():
    try:
        rc, secs = open(f"{t}/{name}.rc").read().split()
    except (OSError, ValueError):
        rc, secs = "?", "?"
    try:
        a = [json.loads(line)["loss"] for line in open(f"{t}/{ref}.jsonl")]
        b = [json.loads(line)["loss"] for line in open(f"{t}/{name}.jsonl")]
        if not (len(a) == len(b) == 3):
            raise ValueError(f"{len(b)} steps logged, the reference {len(a)}")
        diff = max(abs(x - y) for x, y in zip(a, b))
        good = diff <= 1e-4 * max(abs(x) for x in a)
        ok += good
        print(f"{name}: exit {rc}, {secs} s, max loss difference {diff:.2e} over 3 steps: {'ok' if good else 'DIFFERS'}")
    except (OSError, ValueError) as err:
        tail = " | ".join(open(f"{t}/{name}.out").read().strip().splitlines()[-4:]) if rc != "?" else ""
        print(f"{name}: exit {rc} ({'124: killed at the run timeout' if rc == '124' else 'failed'}), {secs} s, "
              f"no losses ({err}); {tail[-600:]}")
print(f"ranks: {ok} of {len(cases)} cases give the one-device losses")
PY
grep -h "^plan:" "$t/dp.out" "$t/gpu+cpu.out" 2>/dev/null | head -2
echo "ranks check done in $(( $(date +%s) - start )) s"
