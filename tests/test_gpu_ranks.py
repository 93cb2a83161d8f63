"""GPU runs over several ranks, on the emulated device: every strategy gives the 1-device losses.

`hspmd run -n 2 --device cuda` under the test switch `HSPMD_EMULATE_GPU=1` runs each rank's
GPU plan on an emulated device: the collectives, the all-reduce buckets and a pipeline's sends
host-staged through MPI, the micro-batch sums as a kernel, the kernels that read their piece's
global position (a dropout mask, a vocabulary range, an embedding's rows) built with the rank's
values. What the GPU machine runs with two ranks on one GPU (`benchmarks/gpu_check.sh`), here
without one. A GPU group beside a CPU group (`device=` per group) sums across them as CPU
groups do.

Sampled per run (`HSPMD_TEST_SEED`, printed in pytest's header; the test ids name the cases):
`CASES` runs one case of each kind (`_kind`: dp, dropout, tp, a pipeline, ep, a GPU group beside
a CPU group), the parameter-server workers on GPUs one of ps and hybrid; successive runs cover
every case.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import EXAMPLES, run_cli, sampled_kinds

from hspmd.compiler import compile_script
from hspmd.frontend.script import load_script
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.cuda.emulated import EmulatedDevice
from hspmd.runtime.cuda.plan import DevicePlanError, build_device_plan

SMALL = {"model.layers": 2, "model.d_model": 32, "model.seq_len": 16, "data.batch_size": 8}
EMULATE = {"HSPMD_EMULATE_GPU": "1"}


def _sets(config: dict) -> list[str]:
    return [a for kv in config.items() for a in ("--set", f"{kv[0]}={kv[1]}")]


def _log(path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(path).read().splitlines()]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """Return the losses of 3 steps on one CPU device, per (script, config) (made once each)."""
    made: dict = {}

    def losses(script: str, config: dict) -> list[float]:
        key = (script, tuple(sorted(config.items())))
        if key not in made:
            log = tmp_path_factory.mktemp("ref") / "ref.jsonl"
            run_cli("hspmd", "run", "-n", "1", os.path.join(EXAMPLES, script), "--device", "cpu", "--steps", "3",
                    "--log", str(log), *_sets(config), check=True, timeout=600)
            made[key] = _log(log)
        return made[key]

    return losses


CASES = [
    ("gpt.py", "[0,1]: dp=2", SMALL),
    ("gpt.py", "[0,1]: tp=2", SMALL),
    ("gpt.py", "[0,1]: pp=2", {**SMALL, "microbatches": 4, "pipeline_schedule": "1f1b"}),
    ("gpt.py", "[0,1]: dp=2 zero=1", SMALL),
    ("gpt.py", "[0,1]: dp=2 zero=3 recompute=block", SMALL),
    ("moe.py", "[0,1]: ep=2", {}),
    ("gpt.py", "[0,1]: dp=2", {**SMALL, "model.dropout": 0.1}),
    ("gpt.py", "[0,1]: pp=2", {**SMALL, "microbatches": 4, "pipeline_schedule": "1f1b", "model.dropout": 0.1}),
    ("llama.py", "[0,1]: tp=2", SMALL),
    ("gpt.py", "[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu share=1", SMALL),
]


def _kind(case) -> str:
    """The path a case tests: a dropout mask of each rank's piece, a GPU group beside a CPU group,
    ep, a pipeline, tp or dp."""
    _, strategy, config = case
    if config.get("model.dropout"):
        return "dropout"
    return next(k for k in ("device=", "ep=", "pp=", "tp=", "dp=") if k in strategy)


RUN_CASES = sampled_kinds(CASES, _kind, "gpu-ranks")


@pytest.mark.parametrize("script,strategy,config", RUN_CASES,
                         ids=[f"{c[0]}:{c[1]}{'+drop' if c[2].get('model.dropout') else ''}" for c in RUN_CASES])
def test_two_gpu_ranks_give_the_one_device_losses(tmp_path, one_device, script, strategy, config):
    """A run tests one case of each kind (`_kind`) of `CASES`, sampled by its seed."""
    log = tmp_path / "gpu.jsonl"
    device = [] if "device=" in strategy else ["--device", "cuda"]  # the groups say which kind each is
    out = run_cli("hspmd", "run", "-n", "2", os.path.join(EXAMPLES, script), "--strategy", strategy, *device,
                  "--steps", "3", "--log", str(log), *_sets(config), timeout=600, env=EMULATE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "plan: on an emulated GPU" in out.stdout
    np.testing.assert_allclose(_log(log), one_device(script, config), rtol=1e-4, atol=1e-5)


def test_kernels_reading_their_piece_are_built_with_each_ranks_values():
    """dp=2 with dropout: the mask's kernel holds its rank's offsets (rank 1's piece starts half
    a batch in), so the two ranks build different sources from one program."""
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), {**SMALL, "model.dropout": 0.1})
    compiled = compile_script(script, "[0,1]: dp=2", 2)
    ((_, device),) = compiled.device_groups()
    dropouts = [op for op in device.walk() if op.name == "kernel.fused" and op.rank_values is not None
                and "dropout" in op.kernel.data]
    assert dropouts
    op = dropouts[0]
    assert op.source_for(0) != op.source_for(1)
    assert f"#define {op.kernel.data}_RV0 0LL" in op.source_for(0)
    assert f"#define {op.kernel.data}_RV0 {SMALL['data.batch_size'] // 2}LL" in op.source_for(1)
    assert op.source_for(7) == op.source.data  # a rank the layout does not name: the whole-tensor defaults


def test_a_plan_with_collectives_needs_the_ranks_communicator():
    script = load_script(os.path.join(EXAMPLES, "mlp.py"))
    compiled = compile_script(script, "[0,1]: tp=2", 2)
    ((_, device),) = compiled.device_groups()
    fn = next(op for op in device.walk() if getattr(op, "sym_name", None) is not None
              and op.sym_name.data == "train_step")
    with pytest.raises(DevicePlanError, match="communicator"):
        build_device_plan(fn, 0, EmulatedDevice())
    comm, _ = InProcessCommunicator.create_world(2)
    plan = build_device_plan(fn, 0, EmulatedDevice(), communicator=comm, cuda_graph=True)
    assert any(getattr(c, "host_staged", False) for c in plan.calls)


def test_a_checkpoint_of_two_gpu_ranks_resumes_on_cpus_under_another_strategy_and_back(tmp_path):
    gpt, sets = os.path.join(EXAMPLES, "gpt.py"), _sets(SMALL)
    run_cli("hspmd", "run", "-n", "1", gpt, "--device", "cpu", "--steps", "4", "--log", str(tmp_path / "ref.jsonl"),
            *sets, check=True, timeout=600)
    ref = _log(tmp_path / "ref.jsonl")
    for first, second, (s1, s2) in (("cuda", "cpu", ("[0,1]: tp=2", "[0,1]: dp=2")),
                                    ("cpu", "cuda", ("[0,1]: dp=2", "[0,1]: tp=2"))):
        d, log = tmp_path / f"ck-{first}", tmp_path / f"{first}-{second}.jsonl"
        run_cli("hspmd", "run", "-n", "2", gpt, "--strategy", s1, "--device", first, "--steps", "2",
                "--checkpoint-dir", str(d), *sets, check=True, timeout=600, env=EMULATE)
        run_cli("hspmd", "run", "-n", "2", gpt, "--strategy", s2, "--device", second, "--steps", "4", "--resume",
                str(d), "--log", str(log), *sets, check=True, timeout=600, env=EMULATE)
        np.testing.assert_allclose(_log(log), ref[2:], rtol=1e-6, atol=1e-6)


def test_gpu_ranks_switch_strategies_in_memory_and_trace_every_rank(tmp_path):
    """Graph switching (dp=2 <-> tp=2 every 2 steps) from device arrays: the CPU run's losses;
    `--trace` holds both ranks' calls (traced steps run call by call: the plan lines say no graphs)."""
    gpt, sets = os.path.join(EXAMPLES, "gpt.py"), _sets(SMALL)
    switching = ["--strategy", "[0,1]: dp=2", "--strategy", "[0,1]: tp=2", "--switch-every", "2", "--steps", "5"]
    run_cli("hspmd", "run", "-n", "2", gpt, *switching, "--device", "cpu", "--log", str(tmp_path / "cpu.jsonl"),
            *sets, check=True, timeout=600)
    out = run_cli("hspmd", "run", "-n", "2", gpt, *switching, "--device", "cuda", "--log", str(tmp_path / "gpu.jsonl"),
                  "--trace", str(tmp_path / "trace.json"), *sets, check=True, timeout=600, env=EMULATE)
    assert "calls a step" in out.stdout and "CUDA graph" not in out.stdout
    got = [json.loads(line) for line in open(tmp_path / "gpu.jsonl").read().splitlines()]
    assert [g["strategy"] for g in got] == [0, 0, 1, 1, 0]
    np.testing.assert_allclose(_log(tmp_path / "gpu.jsonl"), _log(tmp_path / "cpu.jsonl"), rtol=1e-5)
    events = json.load(open(tmp_path / "trace.json"))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert {e.get("pid") for e in events if str(e.get("name", "")).startswith("kernel.fused")} == {0, 1}


@pytest.mark.parametrize("script_name,strategy,capture", [
    ("gpt.py", "[0,1]: dp=2", False), ("gpt.py", "[0,1]: dp=2", True), ("gpt.py", "[0,1]: tp=2", False),
    ("gpt.py", "[0,1]: dp=2 zero=1", True), ("moe.py", "[0,1]: ep=2", False)])
def test_collectives_of_ranks_on_distinct_gpus_go_through_nccl_with_the_same_losses(script_name, strategy, capture,
                                                                                     monkeypatch):
    """Two ranks as threads, each on an emulated device of its own, NCCL the stand-in of
    `tests/fake_nccl.py` (host addresses as device pointers): the groups on distinct GPUs sum
    through `NcclCommunicator` on the device arrays (buckets in their place on the side stream,
    which the emulated device runs late, at the join; all-reduces, leading-dim gathers and
    scatters, all-to-alls), the rest host-staged; the losses of the host-staged run. Where NCCL
    allows capture (`capture`) its calls are in the step's graphs, else between them. Buckets of
    8 KiB make several per step: under capture each fork of the side stream is joined in the
    graph it was forked in (the emulated device refuses a capture that leaves one unjoined, as
    CUDA does), so dp captures one graph, and every run of calls between host calls is captured."""
    from fake_nccl import FakeNccl

    from hspmd.runtime.comm.inprocess import run_spmd
    from hspmd.runtime.comm.nccl import NcclCommunicator
    from conftest import train_plan, train_step

    script = load_script(os.path.join(EXAMPLES, script_name), SMALL if script_name == "gpt.py" else {})
    compiled = compile_script(script, strategy, 2)
    ((_, device),) = compiled.device_groups()
    fake = FakeNccl()
    monkeypatch.setattr(NcclCommunicator, "captures", property(lambda self: capture))
    monkeypatch.setenv("HSPMD_BUCKET_BYTES", "8192")
    through: list[str] = []
    if "ep=" in strategy:  # the experts' tokens go through NCCL's all-to-all
        real = NcclCommunicator.all_to_all

        def all_to_all(self, *args, **kw):
            through.append("all_to_all")
            return real(self, *args, **kw)

        monkeypatch.setattr(NcclCommunicator, "all_to_all", all_to_all)

    def rank(host, through_nccl: bool):
        nccl = NcclCommunicator(host, stream=0, nccl=fake) if through_nccl else None
        plan = build_device_plan(train_step(device), host.rank, EmulatedDevice(), communicator=host, nccl=nccl,
                                 transport=(lambda g: "nccl") if through_nccl else None)
        losses, _ = train_plan(plan, script, compiled, 3)
        calls = (sum(1 for c in plan.calls if getattr(c, "uncaptured", False) and not getattr(c, "host_staged", False)))
        runs = sum(1 for captured, _ in plan.graph_parts() if captured)
        return losses, calls, len(plan.buckets), (plan.graphs_captured, runs), plan.capture_failures

    staged = run_spmd(2, lambda host: rank(host, False), timeout=300)
    nccl = run_spmd(2, lambda host: rank(host, True), timeout=300)
    assert staged[0][1] == 0 and (nccl[0][1] == 0 if capture else nccl[0][1] > 0) and nccl[1][1] == nccl[0][1]
    np.testing.assert_allclose(nccl[0][0], staged[0][0], rtol=1e-6)
    assert [r[4] for r in staged] == [[], []]  # MPI's buckets: polls between the graphs, every capture taken
    for _, _, buckets, graphs, failures in nccl:
        assert failures == []
        if strategy == "[0,1]: dp=2":  # the gradients in several buckets, all in the one graph
            assert buckets > 2 and (graphs[0] == 1 or not capture)
        assert graphs[0] == graphs[1]  # every run between calls left out of the graphs: captured
    assert ("all_to_all" in through) == ("ep=" in strategy)


@pytest.mark.mpi
def test_gpu_ranks_restart_elastically_on_the_ranks_left_with_the_one_device_losses(tmp_path):
    """`--elastic` with `--device cuda`: rank 1 killed at step 6 of 3 GPU ranks, the run resumes
    from the step-3 checkpoint on 2 (the log appended: steps 4 and 5 again), with the CPU's 1-device losses."""
    gpt, log = os.path.join(EXAMPLES, "gpt.py"), tmp_path / "e.jsonl"
    ref = tmp_path / "ref.jsonl"
    run_cli("hspmd", "run", "-n", "1", gpt, "--device", "cpu", "--steps", "7", "--log", str(ref), *_sets(SMALL),
            check=True, timeout=600)
    proc = run_cli("hspmd", "run", "-n", "3", gpt, "--device", "cuda", "--steps", "7", "--elastic", "--checkpoint-dir",
                   str(tmp_path / "D"), "--checkpoint-every", "3", "--log", str(log), *_sets(SMALL),
                   check=True, timeout=900, env={**EMULATE, "HSPMD_FAULT": "1:6"})
    said = [line for line in proc.stderr.splitlines() if line.startswith("hspmd run: ")]
    assert said == [f"hspmd run: rank 1 died at step ~6 (SIGKILL); resuming from {tmp_path / 'D' / 'step-3'} "
                    f"on 2 ranks under '[0,1]: dp=2' (restart 1 of 3)"]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    got = [r for r in rows if "event" not in r]  # the log is appended to: steps 4 and 5 twice, a restart line
    assert [r["event"] for r in rows if "event" in r] == ["restart"]
    assert [g["step"] for g in got] == [1, 2, 3, 4, 5, 4, 5, 6, 7] and [g["ranks"] for g in got] == [3] * 5 + [2] * 4
    want = _log(ref)
    np.testing.assert_allclose([g["loss"] for g in got], [want[g["step"] - 1] for g in got], rtol=1e-5)


@pytest.mark.mpi
def test_a_gpu_rank_leaves_gracefully_and_the_others_go_on_with_the_one_device_losses(tmp_path):
    """SIGTERM to GPU rank 2 at step 4 (`HSPMD_LEAVE`): the ranks switch from dp=3 zero=1 to tp=2
    in memory (device arrays through the host), and the losses stay the 1-device ones."""
    gpt, small = os.path.join(EXAMPLES, "gpt.py"), _sets({**SMALL, "data.batch_size": 12})
    ref, log = tmp_path / "ref.jsonl", tmp_path / "leave.jsonl"
    run_cli("hspmd", "run", "-n", "1", gpt, "--device", "cpu", "--steps", "6", "--log", str(ref), *small,
            check=True, timeout=600)
    run_cli("hspmd", "run", "-n", "3", gpt, "--device", "cuda", "--steps", "6", "--log", str(log), *small,
            "--strategy", "[0-2]: dp=3 zero=1", "--strategy", "[0,1]: tp=2", check=True, timeout=600,
            env={**EMULATE, "HSPMD_LEAVE": "2:4"})
    got = [json.loads(line) for line in log.read_text().splitlines()]
    assert [g.get("left") for g in got] == [None] * 3 + [[2]] + [None] * 2
    assert [g["strategy"] for g in got] == [0] * 3 + [1] * 3
    np.testing.assert_allclose([g["loss"] for g in got], _log(ref), rtol=1e-5)


def test_dropout_in_a_pipeline_stage_beside_another_group_draws_its_virtual_devices_masks(tmp_path, one_device):
    """A 2-stage pipeline (2 micro-batches) beside a data-parallel rank, with dropout: each GPU
    rank's mask kernel takes, per micro-batch, the piece of that micro-batch's virtual device
    (rank values for every micro-batch, read at the variant's `K_MB`): the 1-device losses."""
    config = {**SMALL, "model.dropout": 0.2, "microbatches": 2}
    log = tmp_path / "gpu.jsonl"
    out = run_cli("hspmd", "run", "-n", "3", os.path.join(EXAMPLES, "gpt.py"), "--strategy",
                  "[0,1]: pp=2 share=3 | [2]: dp=1 share=1", "--device", "cuda", "--steps", "3", "--log", str(log),
                  *_sets(config), timeout=600, env=EMULATE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    np.testing.assert_allclose(_log(log), one_device("gpt.py", {**SMALL, "model.dropout": 0.2}), rtol=1e-4, atol=1e-5)
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), {**config, "model.dropout": 0.2})
    compiled = compile_script(script, "[0,1]: pp=2 share=3 | [2]: dp=1 share=1", 3)
    masks = [op for _, program in compiled.device_groups() for op in program.walk()
             if op.name == "kernel.fused" and "dropout" in op.kernel.data and op.rank_values is not None
             and "hs_start" in op.source.data]
    assert masks, "no dropout kernel over virtual devices"
    from hspmd.codegen.nvrtc_check import check_module, nvrtc_status

    if nvrtc_status()[0]:  # the kernels with their table of starts compile for sm_80 and sm_90
        for _, program in compiled.device_groups():
            assert all(size > 0 for size in check_module(program).values())


def test_the_emulated_side_stream_runs_its_work_when_the_plan_joins_it():
    device, done = EmulatedDevice(), []
    fork, side, join = device.prepare_fork(), device.prepare_on_side(lambda stream: done.append(stream)), \
        device.prepare_join()
    fork()
    side()
    assert done == []  # queued: a read of its results before the join reads them unwritten
    join()
    assert done == [0]
    side()
    device.download(device.alloc(4), (1,), np.float32)  # a download waits for every stream
    assert done == [0, 0]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", sampled_kinds(["[0,1]: dp=2 comm=ps consistency=bsp",
                                                   "[0,1]: dp=2 comm=hybrid consistency=bsp"], lambda s: "ps", "gpu-ps"))
def test_parameter_server_workers_on_gpus_log_the_cpu_workers_losses(tmp_path, strategy):
    """`--servers 1 --device cuda`: the workers run the worker's GPU program (the state pulled on
    the host, uploaded each step; the gradients downloaded and pushed), the server on the host.
    A run tests comm=ps or comm=hybrid (the same worker program), sampled by its seed."""
    ctr, logs = os.path.join(EXAMPLES, "ctr.py"), {}
    for device in ("cpu", "cuda"):
        logs[device] = tmp_path / f"{device}.jsonl"
        run_cli("hspmd", "run", "-n", "2", "--servers", "1", "--strategy", strategy, ctr, "--steps", "3",
                "--device", device, "--log", str(logs[device]), check=True, timeout=600, env=EMULATE)
    losses = {d: [json.loads(line)["loss"] for line in open(p) if '"loss"' in line] for d, p in logs.items()}
    assert len(losses["cuda"]) == 3
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-6)


def test_parameter_servers_with_gpu_and_cpu_workers_are_refused_in_one_line():
    proc = run_cli("hspmd", "run", "-n", "2", "--servers", "1", "--strategy", "[0,1]: dp=2 comm=ps consistency=bsp",
                   os.path.join(EXAMPLES, "ctr.py"), "--device", "cuda,cpu", env=EMULATE)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "hspmd: error: --servers needs one device kind for every worker (got --device cuda,cpu); the servers run "
        "on the host"]
