#!/usr/bin/env bash
# The GPU machine's checks (issue 38), as two commands of one script, each well inside what the
# machine is lent for (15 minutes in all, start-up included: ../shared/gpu/README.md). Prepare
# here, in the checkout, once: `bash ../shared/gpu/prepare_wheels.sh` (xdsl, lark and the test
# tools as wheels in .whl/, which the machine lacks), then:
#
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=400)
#     run(command="bash benchmarks/gpu_check.sh ranks", carry=[".whl"], timeout_s=270)
#
# Part 1, one GPU rank: at most 350 s (the stage timeouts below add up to 345 s; the run's 400 s
# leave room for the transfers). The setup (the wheels, the versions, nvidia-smi, the heading for
# benchmarks/RESULTS.md), then at once, on 16 cores and the one GPU (they check numbers, not
# times): the gpu-marked tests in five pytest processes, and `hspmd run --device cuda` (20 steps,
# untraced: its step captured as a CUDA graph, a refused capture said on stderr) and a traced run
# (3 steps) against `--device cpu`. Then alone, timed: benchmarks/gpu_step_vs_torch.py (tiny and
# medium in float32 and bfloat16, the GPT-2-small shape in bfloat16; torch.compile where a target
# asks for it: medium float32, GPT-2-small bfloat16), each target's ratio met or missed.
#
# Part 2 (`ranks`), several ranks: at most 230 s (the timeouts add up to 225 s). The setup, then
# at once NCCL's gpu-marked test at one rank and benchmarks/gpu_ranks_check.sh (two ranks sharing
# the GPU under dp, tp, pp, zero, ep and a GPU rank beside a CPU rank, against one device; its 9
# runs at once), then alone, timed, benchmarks/gpu_cpu_shares.py (the planner's shares for a GPU
# rank and a CPU rank against a sweep). Start it at once after part 1: the machine stays warm for
# 30 s, and a fresh start costs 1-2 minutes. Expected device time in all: start-up 1-2 minutes +
# part 1 (at most 400 s) + part 2 (at most 270 s) = under 15 minutes.
#
# `bash benchmarks/gpu_check.sh flash` (at most 120 s, timeout_s=150, for spare minutes): flash
# attention against the unfused kernels (benchmarks/gpu_flash_attention.py).
#
# Every stage prints when it started; a stage cut by its timeout says exit 124. Everything the
# issue note needs is printed: the GPU's name and versions, the heading for RESULTS.md
# (`## GPU machine run: <nvidia-smi's name> (<date>)`), each check's result, each target's ratio.
# `bash benchmarks/gpu_check.sh budget` prints what the stage timeouts add up to per part (and
# fails where that passes the part's bound; a test runs it).
set -u
cd "$(dirname "$0")/.."
start=$(date +%s)
part=${1:-one}
# The stage timeouts, in seconds. Setup: the wheels, two nvidia-smi calls, the versions (part 1).
T_PIP=15 T_SMI=5 T_VERSIONS=20
# Part 1: the tests and the runs at once, then the benchmark alone. Part 2: NCCL's test and the
# ranks check at once, then the shares alone. Flash: alone. KILL: a timeout's KILL after its TERM.
T_TESTS=130 T_RUNS=120 T_BENCH=160 T_NCCL=80 T_RANKS=80 T_SHARES=110 T_FLASH=90 KILL=5
BOUND_ONE=350 BOUND_RANKS=230 BOUND_FLASH=120  # each part's bound: run's timeout_s leaves room for the transfers
max() { [ "$1" -gt "$2" ] && echo "$1" || echo "$2"; }
SUM_ONE=$(( T_PIP + 2 * T_SMI + T_VERSIONS + $(max $T_TESTS $T_RUNS) + KILL + T_BENCH + KILL ))
SUM_RANKS=$(( T_PIP + 2 * T_SMI + $(max $T_NCCL $T_RANKS) + KILL + T_SHARES + KILL ))
SUM_FLASH=$(( T_PIP + 2 * T_SMI + T_FLASH + KILL ))
case "$part" in
  one|ranks|flash|budget) ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [ranks|flash|budget]"; exit 2 ;;
esac
if [ "$part" = budget ]; then
  echo "part 1: the stage timeouts add up to $SUM_ONE s (bound $BOUND_ONE s; run with timeout_s=400)"
  echo "part 2: the stage timeouts add up to $SUM_RANKS s (bound $BOUND_RANKS s; run with timeout_s=270)"
  echo "flash: the stage timeouts add up to $SUM_FLASH s (bound $BOUND_FLASH s; run with timeout_s=150)"
  [ "$SUM_ONE" -le "$BOUND_ONE" ] && [ "$SUM_RANKS" -le "$BOUND_RANKS" ] && [ "$SUM_FLASH" -le "$BOUND_FLASH" ]
  exit $?
fi
stage() { echo; echo "== $1 (after $(( $(date +%s) - start )) s)"; }
status() {  # NAME RC: one line, saying when the stage's timeout cut it
  echo "$1: exit $2$([ "$2" = 124 ] && echo ' (killed at its timeout)')"
}

bound=$(case "$part" in ranks) echo "$SUM_RANKS";; flash) echo "$SUM_FLASH";; *) echo "$SUM_ONE";; esac)
stage "setup (part $part: the stage timeouts add up to $bound s)"
if [ -d .whl ]; then
  timeout $T_PIP python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
else
  echo "no .whl/: run ../shared/gpu/prepare_wheels.sh in the checkout first and carry .whl"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  HSPMD_MPIEXEC=/usr/bin/mpirun
name=$(timeout $T_SMI nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
timeout $T_SMI nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "RESULTS.md heading: ## GPU machine run: ${name:-unknown GPU} ($(date -u +%Y-%m-%d))"
echo "git: $(git log --oneline -1 2>/dev/null || echo 'no git here')"
if [ "$part" = one ]; then
  timeout $T_VERSIONS python3 - <<'PY'
import importlib.util, platform
missing = [m for m in ("xdsl", "lark", "numpy", "cupy", "torch", "ml_dtypes", "safetensors", "tqdm", "threadpoolctl",
                       "mpi4py", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
print("missing python modules:", ", ".join(missing) if missing else "none")
line = [f"Python {platform.python_version()}"]


def version(label, get):
    try:
        line.append(f"{label} {get()}")
    except Exception as err:  # noqa: BLE001 - say it and go on
        line.append(f"{label}: {type(err).__name__}: {err}")


version("NumPy", lambda: __import__("numpy").__version__)
version("CuPy", lambda: __import__("cupy").__version__)
version("CUDA runtime", lambda: __import__("cupy").cuda.runtime.runtimeGetVersion())
version("driver", lambda: __import__("cupy").cuda.runtime.driverGetVersion())
version("NVRTC", lambda: __import__("cupy").cuda.nvrtc.getVersion())
version("NCCL", lambda: __import__("cupy.cuda.nccl", fromlist=["nccl"]).get_version())
version("PyTorch", lambda: (lambda torch: f"{torch.__version__} (CUDA {torch.version.cuda})")(__import__("torch")))
print(", ".join(line))
PY
fi
t=$(mktemp -d)

if [ "$part" = ranks ]; then
  stage "at once: NCCL at one rank (gpu-marked) and two ranks on the one GPU (host-staged MPI) against one CPU device"
  ( timeout -k $KILL $T_NCCL python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/test_comm_nccl.py 2>&1 | tail -8 >"$t/nccl.log"
    rc=${PIPESTATUS[0]}; status "pytest" "$rc" >>"$t/nccl.log" ) &
  RUN_TIMEOUT=$(( T_RANKS - 10 )) timeout -k $KILL $T_RANKS bash benchmarks/gpu_ranks_check.sh "$t"; status "ranks check" $?
  wait
  echo "-- NCCL at one rank:"; cat "$t/nccl.log"
  stage "a GPU rank and a CPU rank: the planner's shares against a sweep (timed, alone)"
  timeout -k $KILL $T_SHARES python3 benchmarks/gpu_cpu_shares.py --steps 10 --shares 1:0,3:1,15:1,63:1 --timeout 60
  status "shares" $?
  stage "done"
  exit 0
fi

if [ "$part" = flash ]; then
  stage "flash attention against the unfused kernels"
  timeout -k $KILL $T_FLASH python3 benchmarks/gpu_flash_attention.py --sizes tiny,long --steps 10 --warmup 2
  status "flash attention" $?
  stage "done"
  exit 0
fi

stage "at once: the gpu-marked tests (5 pytest processes) and hspmd run --device cuda against --device cpu"
tests() {  # NAME PYTEST-ARGS...: a pytest process in the background, its tail and exit status in $t/NAME.log
  local name=$1; shift
  ( timeout -k $KILL $T_TESTS python3 -m pytest -q -rfE -p no:cacheprovider --maxfail=5 --durations=5 -m gpu "$@" 2>&1 \
      | tail -25 >"$t/$name.log"
    rc=${PIPESTATUS[0]}; status "pytest" "$rc" >>"$t/$name.log" ) &
}
tests cuda-runs tests/test_gpu_cuda.py -k "not training_steps"
tests cuda-steps tests/test_gpu_cuda.py -k training_steps
tests flash-kernels tests/test_flash_attention.py -k kernels_on_a_gpu
tests flash-steps tests/test_flash_attention.py -k "not kernels_on_a_gpu"
tests others tests/test_gpu_precision.py tests/test_gpu_profile.py tests/test_multi_tensor.py \
  tests/test_embedding_grad_kernel.py tests/test_kernels_pass.py
hs() { timeout -k $KILL $T_RUNS python3 -m hspmd.cli.main "$@"; }
( hs run -n 1 examples/gpt.py --device cpu --steps 20 --log "$t/cpu.jsonl" >"$t/cpu.out" 2>&1; echo $? >"$t/cpu.rc" ) &
( hs run -n 1 examples/gpt.py --device cuda --steps 20 --log "$t/gpu.jsonl" >"$t/gpu.out" 2>"$t/gpu.err"
  echo $? >"$t/gpu.rc" ) &
( hs run -n 1 examples/gpt.py --device cuda --steps 3 --log "$t/traced.jsonl" --trace "$t/trace.json" >"$t/traced.out" 2>&1
  echo $? >"$t/traced.rc" ) &
sleep 25; timeout $T_SMI nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | head -12
wait
for name in cuda-runs cuda-steps flash-kernels flash-steps others; do echo "-- pytest $name:"; cat "$t/$name.log"; done
echo "-- hspmd run --device cuda (20 steps, untraced), exit $(cat "$t/gpu.rc" 2>/dev/null):"
grep -h "^plan:" "$t/gpu.out"; tail -2 "$t/gpu.out"; tail -3 "$t/gpu.err"
echo "-- --device cpu exit $(cat "$t/cpu.rc" 2>/dev/null); traced --device cuda exit $(cat "$t/traced.rc" 2>/dev/null)"
python3 - "$t" <<'PY'
import json, sys
t = sys.argv[1]


def losses(name):
    try:
        return [json.loads(line)["loss"] for line in open(f"{t}/{name}.jsonl")]
    except (OSError, ValueError) as err:
        print(f"{name}: no losses ({err})")
        return []


cpu, gpu, traced = losses("cpu"), losses("gpu"), losses("traced")
for name, got in (("untraced", gpu), ("traced", traced)):
    if got and cpu:
        diff = max(abs(x / y - 1) for x, y in zip(got, cpu))
        print(f"--device cuda ({name}, {len(got)} steps) against --device cpu: max relative loss difference "
              f"{diff:.2e}: {'ok' if diff <= 1e-4 else 'DIFFERS'}")
err = open(f"{t}/gpu.err").read() if gpu else ""
print("CUDA graph capture (untraced run):", "REFUSED: " + err.strip().splitlines()[-1][:300]
      if "could not be captured" in err else "no capture refused" if gpu else "not run")
try:
    ev = json.load(open(f"{t}/trace.json"))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    print("trace: kernel events", sum(1 for e in ev if str(e.get("name", "")).startswith("kernel.fused")),
          "GEMM events", sum(1 for e in ev if e.get("name") == "graph.matmul"))
except (OSError, ValueError) as err:
    print(f"trace: none ({err})")
PY

stage "benchmark: one GPT step, hspmd against PyTorch eager and torch.compile (timed, alone)"
timeout -k $KILL $T_BENCH python3 benchmarks/gpu_step_vs_torch.py --sizes tiny,medium,gpt2:bfloat16 --steps 15 --warmup 3
status "benchmark" $?
stage "done"
