#!/usr/bin/env bash
# The GPU machine's checks, as two commands of one script (../shared/gpu/README.md); run from
# the project root, with .whl/ carried along (made here by ../shared/gpu/prepare_wheels.sh).
#
# Part 1, one GPU rank (issue 27; about 8 minutes): what the machine is, the gpu-marked tests
# (the GPU runtime against the CPU backend), `hspmd run --device cuda` against `--device cpu`,
# flash attention against the unfused kernels (benchmarks/gpu_flash_attention.py), then
# benchmarks/gpu_step_vs_torch.py:
#
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=560)
#
# Part 2, several ranks (issue 28; about 5 minutes): NCCL's gpu-marked test at one rank, two ranks
# sharing the GPU under every strategy and a GPU rank beside a CPU rank
# (benchmarks/gpu_ranks_check.sh), then the planner's shares for a GPU rank and a CPU rank
# against a sweep (benchmarks/gpu_cpu_shares.py):
#
#     run(command="bash benchmarks/gpu_check.sh ranks", carry=[".whl"], timeout_s=400)
set -u
cd "$(dirname "$0")/.."
start=$(date +%s)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
else
  echo "no .whl/: run ../shared/gpu/prepare_wheels.sh in the checkout first and carry .whl"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  HSPMD_MPIEXEC=/usr/bin/mpirun
python3 - <<'PY'
import importlib
missing = [m for m in ("xdsl", "lark", "numpy", "cupy", "torch", "ml_dtypes", "safetensors", "tqdm", "threadpoolctl",
                       "mpi4py", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
print("missing python modules:", ", ".join(missing) if missing else "none")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${1:-}" = ranks ]; then
  t=$(mktemp -d)
  echo "== NCCL at one rank (gpu-marked)"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_comm_nccl.py 2>&1 | tail -5
  echo "== two ranks on the one GPU (host-staged MPI) against one CPU device, 3 steps each (after $(( $(date +%s) - start )) s)"
  timeout 180 bash benchmarks/gpu_ranks_check.sh "$t"
  echo "== a GPU rank and a CPU rank: the planner's shares against a sweep (after $(( $(date +%s) - start )) s)"
  left=$(( 380 - ($(date +%s) - start) ))
  timeout $(( left > 60 ? left : 60 )) python3 benchmarks/gpu_cpu_shares.py --steps 12
  echo "== done in $(( $(date +%s) - start )) s"
  exit 0
fi
echo "== gpu-marked tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_gpu_cuda.py tests/test_gpu_precision.py tests/test_gpu_profile.py \
  tests/test_flash_attention.py tests/test_multi_tensor.py tests/test_embedding_grad_kernel.py 2>&1 | tail -25
echo "== hspmd run --device cuda (20 steps) against --device cpu"
t=$(mktemp -d)
timeout 120 python3 -m hspmd.cli.main run -n 1 examples/gpt.py --device cpu --steps 20 --log "$t/cpu.jsonl" >"$t/cpu.out" 2>&1
timeout 120 python3 -m hspmd.cli.main run -n 1 examples/gpt.py --device cuda --steps 20 --log "$t/gpu.jsonl" \
  --trace "$t/trace.json" >"$t/gpu.out" 2>&1 &
pid=$!
sleep 15; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
wait $pid; echo "exit $?"; head -3 "$t/gpu.out"; tail -2 "$t/gpu.out"
python3 - "$t" <<'PY'
import json, sys
t = sys.argv[1]
a = [json.loads(l)["loss"] for l in open(f"{t}/cpu.jsonl")]
b = [json.loads(l)["loss"] for l in open(f"{t}/gpu.jsonl")]
print(f"max relative loss difference over {len(b)} steps: {max(abs(x / y - 1) for x, y in zip(b, a)):.2e}")
ev = json.load(open(f"{t}/trace.json"))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
print("trace kernel events:", sum(1 for e in ev if str(e.get("name", "")).startswith("kernel.fused")))
PY
echo "== flash attention against the unfused kernels (after $(( $(date +%s) - start )) s)"
timeout 90 python3 benchmarks/gpu_flash_attention.py --sizes tiny,long --steps 10 --warmup 2
echo "== benchmark (after $(( $(date +%s) - start )) s)"
left=$(( 520 - ($(date +%s) - start) ))
timeout $(( left > 60 ? left : 60 )) python3 benchmarks/gpu_step_vs_torch.py --steps 20 --warmup 3
echo "== done in $(( $(date +%s) - start )) s"
