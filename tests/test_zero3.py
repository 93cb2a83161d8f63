"""ZeRO stage 3 (`zero=3`, `shard-parameters`): parameters split over dp, gathered in each layer's
forward and again in its backward, gradients reduce-scattered into the shards, the update on the
shards only; the 1-device losses; checkpoints that resume under zero=3 and under dp=1.

Sampled per run (`HSPMD_TEST_SEED`, printed in pytest's header; the test ids name the cases): the
pipeline sweep runs one case of each example, the `hspmd run` sweep over mpiexec one case of each
kind (one group, unlike groups, a pipeline); successive runs cover every case.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
from conftest import sampled_kinds
from models import Parallel, Reference, check_pair

from generated_model import DEFAULT_SPEC
from hspmd.compiler import compile_script, write_bundle
from hspmd.dialects.dist import layout_of
from hspmd.dialects.levels import physical_groups
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.strategy import StrategyError, parse_strategy
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import CheckpointOptions, train

ROOT = os.path.join(os.path.dirname(__file__), "..")
GPT = os.path.join(ROOT, "examples", "gpt.py")
SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=4",
         "optim.warmup=2", "model.dropout=0.1", "steps=8"]


def _script(extra=()):
    return load_script(GPT, parse_overrides(SMALL + list(extra)))


def _comms(compiled):
    """Return {(op, function): count} over the physical program of group 0."""
    (_, group), *_ = physical_groups(compiled.physical)
    out = collections.Counter()
    for fn in group.body.block.ops:
        for o in fn.walk():
            if o.name.startswith("comm."):
                out[(o.name, fn.sym_name.data)] += 1
    return out


def test_parameters_are_split_and_gathered_per_layer():
    compiled = compile_script(_script(), "[0,1]: dp=2 zero=3", 2)
    params = {o.tensor_name.data: layout_of(o.result) for o in compiled.annotated.walk()
              if o.name == "graph.parameter" and not o.tensor_name.data.startswith("opt.")}
    assert all("split" in str(lay) for lay in params.values()), params
    comms = _comms(compiled)
    # each layer's weights gathered in its forward and again in its backward (12 tensors a block)
    assert comms[("comm.all_gather", "Block_0_fwd")] == 12
    assert comms[("comm.all_gather", "Block_0_bwd")] >= 6
    # gradients reduce-scattered into the shards (a stacked one inside the backward scan, layer by
    # layer); only the loss and the norm's scalar all-reduced
    stacked = [p for p in params if p.startswith("blocks.[")]
    assert comms[("comm.reduce_scatter", "Block_0_bwd")] == len(stacked) == 12
    assert comms[("comm.reduce_scatter", "train_step")] == len(params) - len(stacked)
    assert comms[("comm.all_reduce", "train_step")] == 2
    # nothing gathered after the update: the step's gathers are the embedding's and the head's reads
    base = _comms(compile_script(_script(), "[0,1]: dp=2 zero=2", 2))
    assert comms[("comm.all_gather", "train_step")] < base[("comm.all_gather", "train_step")]


def _schedule(prefetch: bool, strategy: str = "[0,1]: dp=2 zero=3 recompute=block"):
    from hspmd.codegen.schedule import build_schedule

    (_, group), *_ = physical_groups(compile_script(_script(["model.layers=3"]), strategy, 2).physical)
    step = next(f for f in group.body.block.ops if f.sym_name.data == "train_step")
    return build_schedule(step, 0, prefetch=prefetch)


def test_the_next_layers_gathers_are_in_flight_while_a_layer_computes():
    """Prefetch (`codegen/schedule/prefetch.py`): a layer's weights' gathers start while the
    previous layer computes (one layer ahead), are waited on where they stood, and nothing reads
    a gather's result or writes its piece in between; one layer's weights more at the peak."""
    plain, ahead = _schedule(False), _schedule(True)
    gathers = [s for s in plain.steps if s.kind == "op" and s.name == "comm.all_gather"]
    starts = {s.gather: i for i, s in enumerate(ahead.steps) if s.kind == "gather-start"}
    waits = {s.gather: i for i, s in enumerate(ahead.steps) if s.kind == "gather-wait"}
    blocking = [s for s in ahead.steps if s.kind == "op" and s.name == "comm.all_gather"]
    assert set(starts) == set(waits) and len(starts) + len(blocking) == len(gathers)
    assert len(blocking) <= 1  # (the first gather of the step has nothing to start behind)
    overlapped = 0
    for k, begin in starts.items():
        start, end = ahead.steps[begin], waits[k]
        assert begin < end and ahead.steps[end].ins == (start.outs[0], start.ins[0])
        between = ahead.steps[begin + 1:end]
        assert not [s for s in between if start.outs[0] in s.ins or start.ins[0] in s.outs], k
        kernels = [s for s in between if s.kind == "op" and not s.name.startswith("comm.")]
        overlapped += len(kernels) >= 3
        if kernels:
            assert any(s.kind == "gather-poll" and k in s.polls for s in between)
    assert overlapped >= 0.9 * len(starts)
    layer = sum(_bytes(ahead, s.outs[0]) for s in gathers[1:13])  # the gathers of one layer's weights
    assert plain.peak_bytes < ahead.peak_bytes <= plain.peak_bytes + layer


def test_prefetched_gathers_are_traced_and_priced_as_communication():
    """A gather's start is communication in traces, its wait a wait, its polls untraced; the cost
    model prices the started gathers by the all-gather's time for their bytes, as the blocking ones
    (which pay the members' resynchronisation on top)."""
    from hspmd.codegen.cost_model import _walk
    from hspmd.ir.device_profile import DeviceProfile
    from hspmd.runtime.trace import step_label

    plain, ahead = _schedule(False), _schedule(True)
    labels = {s.kind: step_label(s, ahead.slot_types) for s in ahead.steps if s.kind.startswith("gather-")}
    assert labels["gather-start"].cat == "comm" and labels["gather-start"].args["bytes"] > 0
    assert labels["gather-wait"].cat == "wait" and labels["gather-poll"] is None
    profile = DeviceProfile.default_cpu(2)
    walks = [_walk(s, 0, profile, 0.0) for s in (plain, ahead)]
    assert 0.5 * walks[0].comm < walks[1].comm <= walks[0].comm


def _bytes(schedule, slot: int) -> int:
    shape, dtype = schedule.slot_types[slot]
    return int(np.prod(shape)) * dtype.itemsize


def test_prefetch_changes_no_number(tmp_path, monkeypatch):
    bundle = str(tmp_path / "z3")
    write_bundle(compile_script(_script(), "[0,1]: dp=2 zero=3", 2), bundle)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("HSPMD_PREFETCH", flag)
        runs[flag] = _train(bundle, 2, 3)[0]
    assert runs["0"].losses == runs["1"].losses
    for name, value in runs["0"].params.items():
        np.testing.assert_array_equal(runs["1"].params[name], value, err_msg=name)


def test_zero3_key_and_refusals():
    assert str(parse_strategy("[0,1]: dp=2 zero=3")) == "[0,1]: dp=2 zero=3"
    assert str(parse_strategy("[0-3]: dp=2 pp=2 zero=3")) == "[0-3]: dp=2 pp=2 zero=3"
    assert str(parse_strategy("[0-3]: dp=2 ep=2 zero=3")) == "[0-3]: dp=2 zero=3 ep=2"
    with pytest.raises(StrategyError, match="in a pipeline"):
        parse_strategy("[0-7]: dp=2 ep=2 pp=2 zero=3")


PIPE = {"gpt.py": SMALL[:4] + ["data.batch_size=8", "optim.warmup=2", "model.dropout=0.1", "steps=4"],
        "llama.py": ["model.d_model=32", "model.seq_len=8", "model.heads=2", "model.layers=2", "data.batch_size=8",
                     "optim.warmup=2", "model.dropout=0.1", "steps=4"],
        "mlp.py": ["batch_size=16", "hidden=32", "steps=4"]}  # plain SGD: parameters sliced, no states


def _pipe_train(tmp_path, example: str, strategy: str, n: int, extra=(), **kw):
    script = load_script(os.path.join(ROOT, "examples", example), parse_overrides(PIPE[example] + list(extra)))
    bundle = str(tmp_path / f"{example}-{n}-{abs(hash((strategy, *extra, *kw.values())))}")
    compiled = compile_script(script, strategy, n, **kw)
    write_bundle(compiled, bundle)
    return compiled, run_spmd(n, lambda comm: train(bundle, comm, steps=4, quiet=True), timeout=300)


@pytest.mark.parametrize("example,strategy,schedule", sampled_kinds([
    ("gpt.py", "[0-3]: dp=2 pp=2 zero=3", "gpipe"),
    ("gpt.py", "[0-3]: dp=2 pp=2 zero=3 recompute=block", "1f1b"),
    ("llama.py", "[0-3]: dp=2 pp=2 zero=3 recompute=block", "1f1b"),
    ("llama.py", "[0-7]: dp=2 tp=2 pp=2 zero=3", "gpipe"),
    ("mlp.py", "[0-3]: dp=2 pp=2 zero=3", "1f1b"),
], lambda case: case[0], "zero3-pipeline"))
def test_pipeline_stages_shard_their_parameters(tmp_path, example, strategy, schedule):
    """zero=3 in a pipeline (4 micro-batches, dropout): each stage holds 1/dp of its parameters
    between steps, gathers them once per step before its `pipeline.run`, reduce-scatters the
    micro-batches' summed gradients into the slices and updates the slices; the 1-device numbers.
    A run tests one case of each example, sampled by its seed."""
    _, (ref,) = _pipe_train(tmp_path, example, "[0]: dp=1", 1)
    n = 8 if "[0-7]" in strategy else 4
    compiled, ranks = _pipe_train(tmp_path, example, strategy, n, microbatches=4, pipeline_schedule=schedule)
    for r in ranks:
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-4)
    for name, value in ref.params.items():  # gathered from every rank's slice
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-4, atol=5e-5, err_msg=name)
    for _, stage in physical_groups(compiled.physical):
        step = next(f for f in stage.body.block.ops if f.sym_name.data == "train_step")
        params = [o for o in step.body.block.ops if o.name == "graph.parameter"
                  and not o.tensor_name.data.startswith("opt.")]
        # a sliced parameter is read by its gather (before the run) and its update only
        sliced = [o for o in params if sorted(u.operation.name.split(".")[0] for u in o.result.uses)
                  == ["comm", "optim"]]
        # (llama's vocabulary-split embedding under tp keeps its states whole too, as with zero=1)
        assert len(sliced) >= len(params) - 1, [o.tensor_name.data for o in params if o not in sliced]
        ops = [o.name for o in step.body.block.ops]
        run = ops.index("pipeline.run")
        assert ops[:run].count("comm.all_gather") == len(sliced) and "comm.all_gather" not in ops[run:]
        assert not [o for o in step.body.block.ops if o.name == "comm.local_split"
                    and o.operands[0].owner.name == "graph.parameter"]  # the update reads the slice itself


@pytest.mark.parametrize("strategy,n", [
    ("[0,1]: dp=2 zero=3", 2),
    ("[0,1]: dp=2 zero=3 recompute=block", 2),
    ("[0-3]: dp=2 tp=2 zero=3 recompute=selective", 4),
    ("[0,1]: dp=2 zero=3 share=2 | [2]: dp=1 recompute=block share=1", 3),
    ("[0,1]: dp=2 zero=3 share=1 | [2,3]: dp=2 zero=1 share=1", 4),
])
def test_generated_model_trains_as_on_one_device(strategy, n):
    out = check_pair(Reference({**DEFAULT_SPEC, "dropout": 0.1, "layers": 2}), Parallel(strategy, n))
    assert out.refused is None, out.refused


def _train(bundle: str, n: int, steps: int, **options):
    return run_spmd(n, lambda comm: train(bundle, comm, steps=steps, quiet=True,
                                          checkpoints=CheckpointOptions(**options)), timeout=300)


def test_checkpoint_resumes_under_zero3_and_dp1(tmp_path):
    z3, one = str(tmp_path / "z3"), str(tmp_path / "one")
    write_bundle(compile_script(_script(), "[0,1]: dp=2 zero=3", 2), z3)
    write_bundle(compile_script(_script(), "[0]: dp=1", 1), one)
    straight = _train(z3, 2, 8)[0]
    ck = str(tmp_path / "ck")
    _train(z3, 2, 4, directory=ck, every=2)
    from hspmd.runtime.checkpoint.manifest import latest_checkpoint, read_manifest

    m = read_manifest(latest_checkpoint(ck))
    for name in ("wte.weight", "opt.m.wte.weight"):  # parameters too are saved as each rank's shard
        assert sorted(p.file for p in m.tensors[name].pieces) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    resumed = _train(z3, 2, 8, resume=ck)[0]
    assert resumed.losses == straight.losses[4:]
    for name, value in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)
    other = _train(one, 1, 8, resume=ck)[0]
    np.testing.assert_allclose(other.losses, straight.losses[4:], rtol=1e-6)
    for name, value in straight.params.items():
        np.testing.assert_allclose(other.params[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


def _mpi_losses(tmp_path, example: str, n: int, strategy: str, extra: list[str]) -> list[float]:
    import json

    from conftest import EXAMPLES, run_cli

    log = tmp_path / f"{example}-{n}-{abs(hash(strategy))}.jsonl"
    run_cli("hspmd", "run", "-n", str(n), os.path.join(EXAMPLES, example), "--strategy", strategy, "--steps", "4",
            "--log", str(log), "--set", "model.dropout=0.1", *extra, check=True, timeout=600)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


#: the 1-device losses of `hspmd run` per example (every case compares with the same run)
_mpi_one: dict[str, list[float]] = {}


def _mpi_kind(case) -> str:
    strategy = case[2]
    return "pipeline" if "pp=" in strategy else "groups" if "|" in strategy else "one group"


@pytest.mark.mpi
@pytest.mark.parametrize("example,n,strategy,extra", sampled_kinds([
    ("gpt.py", 2, "[0,1]: dp=2 zero=3 recompute=block", []),
    ("llama.py", 4, "[0-3]: dp=2 tp=2 zero=3 recompute=selective", []),
    ("llama.py", 2, "[0,1]: pp=2 recompute=block", ["--set", "microbatches=4", "--set", "pipeline_schedule=1f1b"]),
    ("gpt.py", 3, "[0,1]: dp=2 zero=3 share=2 | [2]: dp=1 recompute=selective share=1", []),
    ("gpt.py", 4, "[0-3]: pp=2 dp=2 zero=3", ["--set", "microbatches=4", "--set", "pipeline_schedule=gpipe"]),
    ("llama.py", 4, "[0-3]: pp=2 dp=2 zero=3 recompute=block",
     ["--set", "microbatches=4", "--set", "pipeline_schedule=1f1b"]),
], _mpi_kind, "zero3-mpi"))
def test_over_mpi_the_single_device_losses(tmp_path, example, n, strategy, extra):
    """A run tests one case of each kind (`_mpi_kind`), sampled by its seed."""
    if example not in _mpi_one:
        _mpi_one[example] = _mpi_losses(tmp_path, example, 1, "[0]: dp=1", [])
    one = _mpi_one[example]
    np.testing.assert_allclose(_mpi_losses(tmp_path, example, n, strategy, extra), one, rtol=1e-4)
