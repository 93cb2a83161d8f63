"""Sharded checkpoints: resume bit-identical under the same strategy, equal within tolerance under
another one (reshard on load), every piece written once, atomic writes, corrupt checkpoints
refused with nothing loaded, and the `hspmd checkpoint` tools.

Runs in-process ranks (`run_spmd`) for the strategy matrix and `hspmd run` (mpiexec) where the
processes matter: the agreement on a corrupt piece, and a pipeline with 1F1B and ZeRO.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from conftest import EXAMPLES, run_cli
from hspmd.codegen.schedule.model import Leaf
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, split
from hspmd.runtime.checkpoint.manifest import latest_checkpoint, read_manifest, step_dirs
from hspmd.runtime.checkpoint.writer import CheckpointWriter, RunInfo, owned_pieces
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import CheckpointOptions, RunError, train

GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=6",
         "optim.warmup=2", "model.dropout=0.1", "steps=8"]
STEPS, HALF = 8, 4


def _bundle(tmp_path, strategy: str, n: int, extra: tuple[str, ...] = ()) -> str:
    path = tmp_path / ("b-" + "".join(c for c in strategy + "-".join(extra) if c.isalnum()))
    if not path.exists():
        script = load_script(GPT, parse_overrides(SMALL + list(extra)))
        write_bundle(compile_script(script, strategy, n), str(path))
    return str(path)


def _train(bundle: str, n: int, steps: int = STEPS, **options):
    return run_spmd(n, lambda comm: train(bundle, comm, steps=steps, quiet=True,
                                          checkpoints=CheckpointOptions(**options)), timeout=300)


def _straight_then_resumed(tmp_path, strategy: str, n: int, extra: tuple[str, ...] = ()):
    bundle = _bundle(tmp_path, strategy, n, extra)
    straight = _train(bundle, n)
    ck = str(tmp_path / "ck")
    _train(bundle, n, HALF, directory=ck, every=2)
    resumed = _train(bundle, n, resume=ck)
    return straight[0], resumed[0], ck


@pytest.mark.parametrize("strategy,extra", [
    ("[0,1]: dp=2", ()),
    ("[0,1]: tp=2", ()),
    ("[0,1]: dp=2 zero=1", ()),
    ("[0,1]: pp=2", ("microbatches=2", "pipeline_schedule=1f1b")),
])
def test_resume_is_bit_identical_under_the_same_strategy(tmp_path, strategy, extra):
    straight, resumed, ck = _straight_then_resumed(tmp_path, strategy, 2, extra)
    assert [k for k, _ in step_dirs(ck)] == [2, 4]
    assert resumed.first_step == HALF + 1
    assert resumed.losses == straight.losses[HALF:]
    assert straight.params.keys() == resumed.params.keys()
    for name, value in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], value, err_msg=name)


@pytest.mark.parametrize("strategy,n", [("[0,1]: tp=2 share=2 | [2]: tp=1 share=1", 3), ("[0]: dp=1", 1)])
def test_resume_reshards_into_another_strategy_and_device_count(tmp_path, strategy, n):
    straight, _, ck = _straight_then_resumed(tmp_path, "[0,1]: dp=2", 2)
    other = _train(_bundle(tmp_path, strategy, n), n, resume=ck)[0]
    np.testing.assert_allclose(other.losses, straight.losses[HALF:], rtol=1e-4)
    for name, value in straight.params.items():
        np.testing.assert_allclose(other.params[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_the_manifest_records_the_run_and_every_piece(tmp_path):
    bundle = _bundle(tmp_path, "[0,1]: dp=2 zero=1", 2)
    ck = str(tmp_path / "ck")
    _train(bundle, 2, HALF, directory=ck, every=HALF)
    m = read_manifest(latest_checkpoint(ck))
    assert (m.step, m.data_position, m.strategy, m.num_devices) == (HALF, HALF, "[0,1]: dp=2 zero=1", 2)
    assert m.lr is not None and m.config["model"]["d_model"] == 32
    moment = m.tensors["opt.m.wte.weight"]  # ZeRO: each rank wrote its own half
    assert sorted(p.file for p in moment.pieces) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert len(m.tensors["wte.weight"].pieces) == 1  # replicated: written once
    assert {"opt.step", "opt.beta1_pow"} <= set(m.tensors)
    files = {f for f in os.listdir(latest_checkpoint(ck))}
    assert files == {"manifest.json", "rank-00000.json", "rank-00001.json",
                     "rank-00000.safetensors", "rank-00001.safetensors"}


def _layouts():
    states = st.sampled_from([
        DistributedStates.of((DUP, 2)), DistributedStates.of((split(0), 2)), DistributedStates.of((split(1), 2)),
        DistributedStates.of((split(0), 2), (DUP, 2)), DistributedStates.of((DUP, 2), (split(1), 2)),
        DistributedStates(),
    ])
    return st.lists(states, min_size=1, max_size=3).flatmap(lambda groups: st.tuples(
        st.just(groups), st.sampled_from([DUP, split(0), split(1)]) if len(groups) > 1 else st.just(DUP)))


@settings(max_examples=60, deadline=None)
@given(_layouts(), st.sampled_from(["w", "opt.m.w", "layers.3.bias"]))
def test_every_element_is_written_by_exactly_one_rank(spec, name):
    groups, hetero = spec
    first, out = 0, []
    for s in groups:
        out.append(Group(tuple(range(first, first + s.num_devices)), s))
        first += s.num_devices
    layout = Layout(tuple(out), hetero)
    leaf = Leaf(name, 0, (24, 12), layout, "float32")
    count = np.zeros((24, 12), dtype=np.int64)
    for rank in layout.devices:
        for _, region in owned_pieces([leaf], rank):
            assert region == tuple((s.start, s.stop) for s in layout.slices(rank, (24, 12)))
            count[tuple(slice(a, b) for a, b in region)] += 1
    assert (count == 1).all()


def test_replicas_share_the_writing():
    layout = Layout.replicated((0, 1))
    leaves = [Leaf(f"t{i}", 0, (4,), layout, "float32") for i in range(40)]
    mine = [len(owned_pieces(leaves, r)) for r in (0, 1)]
    assert sum(mine) == 40 and min(mine) >= 10


def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    leaf = Leaf("w", 0, (4, 3), Layout.replicated((0,)), "float32")
    info = RunInfo("[0]: dp=1", 1, "x.py", {}, 0)
    d = str(tmp_path / "ck")
    writer = CheckpointWriter(d, 0, 1, [leaf], info, keep=2)
    for step in (1, 2, 3):
        writer.save(step, {"w": np.full((4, 3), step, np.float32)}, step, None)
    writer.close()
    assert [k for k, _ in step_dirs(d)] == [2, 3]  # --keep 2

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("hspmd.runtime.checkpoint.writer._write_json", crash)
    writer.save(4, {"w": np.zeros((4, 3), np.float32)}, 4, None)
    with pytest.raises(Exception, match="disk full"):
        writer.close()
    assert latest_checkpoint(d).endswith("step-3")
    assert os.path.isdir(os.path.join(d, "step-4.tmp"))
    monkeypatch.undo()
    CheckpointWriter(d, 0, 1, [leaf], info)  # the next run removes the unfinished one
    assert not os.path.exists(os.path.join(d, "step-4.tmp"))
    assert load_file(os.path.join(d, "step-3", "rank-00000.safetensors"))["w@0:4,0:3"][0, 0] == 3


def test_a_late_rank_0_does_not_remove_what_the_others_write(tmp_path):
    """Rank 0 clears an earlier run's unfinished checkpoints when its writer starts; a rank that
    starts sooner and saves at once must not lose its pieces to that (the ranks wait for it)."""
    import time

    layout = Layout.replicated((0, 1))
    leaves = [Leaf(f"t{i}", 0, (4,), layout, "float32") for i in range(8)]
    info = RunInfo("[0,1]: dp=2", 2, "x.py", {}, 0)
    d = str(tmp_path / "ck")
    os.makedirs(os.path.join(d, "step-1.tmp"))  # left by a crashed run

    def rank(comm):
        if comm.rank == 0:
            time.sleep(0.5)
        writer = CheckpointWriter(d, comm.rank, comm.size, leaves, info, comm=comm)
        writer.save(1, {leaf.name: np.full(4, comm.rank, np.float32) for leaf in leaves}, 1, None)
        writer.close()

    run_spmd(2, rank, timeout=60)
    assert {p.key for e in read_manifest(os.path.join(d, "step-1")).tensors.values() for p in e.pieces} == \
        {f"t{i}@0:4" for i in range(8)}


def _corrupt(path: str, how: str) -> None:
    data = bytearray(open(path, "rb").read())
    if how == "flip":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) - 100]
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "manifest"])
def test_a_bad_checkpoint_is_refused_with_nothing_loaded(tmp_path, how):
    bundle = _bundle(tmp_path, "[0,1]: dp=2", 2)
    ck = str(tmp_path / "ck")
    _train(bundle, 2, HALF, directory=ck, every=HALF)
    step = latest_checkpoint(ck)
    victim = os.path.join(step, "rank-00001.safetensors")
    if how == "missing":
        os.remove(victim)
    elif how == "manifest":
        m = json.load(open(os.path.join(step, "manifest.json")))
        m["tensors"]["wte.weight"]["shape"] = [7, 7]
        m["tensors"]["wte.weight"]["pieces"][0]["region"] = [[0, 7], [0, 7]]
        json.dump(m, open(os.path.join(step, "manifest.json"), "w"))
    else:
        _corrupt(victim, how)
    before = {f: open(os.path.join(step, f), "rb").read() for f in os.listdir(step)}
    with pytest.raises(RunError) as err:
        _train(bundle, 2, resume=ck, directory=ck, every=1)
    text = str(err.value)
    if how == "manifest":
        assert "wte.weight" in text and "[7, 7]" in text
    else:
        assert "rank-00001.safetensors" in text and "tensor '" in text
    assert {f: open(os.path.join(step, f), "rb").read() for f in os.listdir(step)} == before
    assert [k for k, _ in step_dirs(ck)] == [HALF]  # nothing written either


@pytest.mark.mpi
def test_a_corrupt_piece_stops_every_rank_with_one_message(tmp_path):
    ck = tmp_path / "ck"
    args = ["hspmd", "run", "-n", "2", GPT, *[a for s in SMALL for a in ("--set", s)]]
    run_cli(*args, "--steps", "2", "--checkpoint-dir", str(ck), check=True, timeout=300)
    _corrupt(str(ck / "step-2" / "rank-00000.safetensors"), "flip")
    proc = run_cli(*args, "--steps", "4", "--resume", str(ck), timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "rank-00000.safetensors" in errors[0] and "checksum" in errors[0], proc.stderr


@pytest.mark.mpi
def test_pipeline_1f1b_zero_resumes_bit_identical_over_mpi(tmp_path):
    base = ["hspmd", "run", "-n", "4", GPT, "--strategy", "[0-3]: dp=2 pp=2 zero=1",
            *[a for s in SMALL + ["microbatches=2", "pipeline_schedule=1f1b", "data.batch_size=8"] for a in ("--set", s)]]
    # the straight run writes the sharded checkpoint of step 3 on its way (one run fewer than stopping at 3)
    run_cli(*base, "--steps", "6", "--log", str(tmp_path / "a.jsonl"), "--checkpoint", str(tmp_path / "a.npz"),
            "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3", check=True, timeout=400)
    assert [k for k, _ in step_dirs(str(tmp_path / "ck"))] == [3, 6]
    run_cli(*base, "--steps", "6", "--log", str(tmp_path / "b.jsonl"), "--checkpoint", str(tmp_path / "b.npz"),
            "--resume", str(tmp_path / "ck" / "step-3"), check=True, timeout=400)
    a = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
    b = [json.loads(line) for line in open(tmp_path / "b.jsonl")]
    assert [r["step"] for r in b] == [4, 5, 6]
    assert [r["loss"] for r in b] == [r["loss"] for r in a[3:]]
    with np.load(tmp_path / "a.npz") as x, np.load(tmp_path / "b.npz") as y:
        for k in x.files:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_info_export_and_init_from(tmp_path):
    bundle = _bundle(tmp_path, "[0,1]: tp=2", 2)
    ck = str(tmp_path / "ck")
    final = _train(bundle, 2, HALF, directory=ck, every=2)[0].params
    info = run_cli("hspmd", "checkpoint", "info", ck, check=True).stdout
    assert "steps 2, 4" in info and "tp=2" in info and "pieces verified" in info
    out = str(tmp_path / "model.safetensors")
    run_cli("hspmd", "checkpoint", "export", ck, "--to", out, check=True)
    exported = load_file(out)
    assert set(exported) == {k for k in final if not k.startswith("opt.")}
    for k, v in exported.items():
        np.testing.assert_array_equal(v, final[k], err_msg=k)
    # a run on other devices starts from the exported parameters (fresh optimizer states)
    one = _bundle(tmp_path, "[0]: dp=1", 1)
    started = run_spmd(1, lambda comm: train(one, comm, steps=1, quiet=True, keep_outputs=True,
                                             checkpoints=CheckpointOptions(init_from=out)))[0]
    for k, v in exported.items():
        np.testing.assert_array_equal(started.initial_params[k], v, err_msg=k)
    shutil.copy(out, tmp_path / "bad.safetensors")
    _corrupt(str(tmp_path / "bad.safetensors"), "flip")
    bad = run_cli("hspmd", "run", GPT, *[a for s in SMALL for a in ("--set", s)], "--steps", "1",
                  "--init-from", str(tmp_path / "bad.safetensors"))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "bad.safetensors" in bad.stderr


def test_cli_refuses_bad_checkpoint_options(tmp_path):
    for extra, message in [(["--resume", str(tmp_path / "nowhere")], "no such checkpoint directory"),
                           (["--checkpoint-every", "2"], "need --checkpoint-dir"),
                           (["--init-from", str(tmp_path / "none.safetensors")], "no such file")]:
        proc = run_cli("hspmd", "run", GPT, "--steps", "1", *extra)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = run_cli("hspmd", "checkpoint", "info", str(tmp_path))
    assert proc.returncode == 1 and "no complete checkpoint" in proc.stderr
