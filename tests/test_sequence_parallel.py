"""Sequence parallelism (Megatron-SP, strategy key `sp=1`): layouts, collectives, same numbers.

With `sp=1` the residual stream between a row-parallel matmul and the next column-parallel one
lies split along the sequence over the tp ranks: the row-parallel partial sums are
reduce-scattered into it (no all-reduce in the blocks' forward), and the column-parallel input
is all-gathered from it. GPT and LLaMA train on `[0,1]: tp=2 sp=1` and `[0-3]: dp=2 tp=2 sp=1`
in-process with the 1-device losses and parameters; bad inputs get one message.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hspmd.dialects.dist import layout_of
from hspmd.compiler import compile_script, write_bundle
from hspmd.codegen.report import collective_report
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train
from hspmd.transforms.util import PassError
from test_tensor_parallel import STEPS, _one_device, _script


def _blocks(compiled, prefix: str) -> Counter:
    """Return {collective: count} of the block functions named `prefix*` (one call each)."""
    return Counter(r.op for r in collective_report(compiled.physical) if r.function.startswith(prefix))


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_blocks_reduce_scatter_and_all_gather_instead_of_all_reduce(example):
    compiled = compile_script(_script(example), "[0,1]: tp=2 sp=1", 2)
    rows = collective_report(compiled.physical)
    fwd = _blocks(compiled, "Block_0_fwd")
    # per block: (all-gather the column input, reduce-scatter the row output) for attention and MLP
    assert fwd == Counter({"comm.all_gather": 2, "comm.reduce_scatter": 2}), fwd
    bwd = _blocks(compiled, "Block_0_bwd")
    # per pair: all-gather the output gradient and the input (for the weight gradient), and
    # reduce-scatter the input gradient
    assert bwd == Counter({"comm.all_gather": 4, "comm.reduce_scatter": 2}), bwd
    # the all-gathers and reduce-scatters move half a [B, T, D] activation per rank: 4 x 8 x 32 floats
    for r in rows:
        if r.function.startswith("Block_0") and r.op in ("comm.all_gather", "comm.reduce_scatter"):
            assert r.bytes_per_call == 4 * 8 * 32 * 4 // 2, r

    plain = compile_script(_script(example), "[0,1]: tp=2", 2)
    assert _blocks(plain, "Block_0_fwd") == Counter({"comm.all_reduce": 2})
    # the same bytes in the blocks: an all-reduce is a reduce-scatter plus an all-gather
    total = sum(r.bytes_per_step for r in rows if r.function.startswith("Block_0_fwd"))
    assert total == sum(r.bytes_per_step for r in collective_report(plain.physical)
                        if r.function.startswith("Block_0_fwd"))


def test_residual_stream_is_split_along_the_sequence():
    compiled = compile_script(_script("gpt.py"), "[0-3]: dp=2 tp=2 sp=1", 4)
    step = next(f for f in compiled.annotated.body.block.ops if f.sym_name.data == "train_step")
    (scan,) = [o for o in step.body.block.ops if o.name == "graph.scan" and o.callee.string_value() == "Block_0_fwd"]
    ((arg, res),) = scan.carries()  # the residual stream in and out of the blocks: batch over dp, sequence over tp
    assert str(layout_of(scan.operands[arg])) == "[0-3]: split(0)=2, split(1)=2"
    assert str(layout_of(scan.results[res])) == "[0-3]: split(0)=2, split(1)=2"
    assert scan.num_iterations == 2


def _train(tmp_path, example: str, strategy: str, n: int):
    bundle = tmp_path / f"{example}-{n}-sp"
    write_bundle(compile_script(_script(example), strategy, n), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=STEPS, quiet=True), timeout=300)[0]


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
@pytest.mark.parametrize("n,strategy", [(2, "[0,1]: tp=2 sp=1"), (4, "[0-3]: dp=2 tp=2 sp=1")])
def test_sequence_parallel_equals_one_device(tmp_path, example, n, strategy):
    ref = _one_device(tmp_path, example)
    got = _train(tmp_path, example, strategy, n)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-4)
    for name, value in ref.params.items():  # Adam: see test_tensor_parallel for the absolute tolerance
        np.testing.assert_allclose(got.params[name], value, rtol=1e-4, atol=5e-5, err_msg=name)


def test_bad_sequence_parallel_inputs_get_one_message():
    with pytest.raises(PassError) as err:
        compile_script(_script("gpt.py", ["model.seq_len=7"]), "[0,1]: tp=2 sp=1", 2)
    text = str(err.value)
    assert "sp=1" in text and "[4, 7, 32]" in text and "tp=2" in text and "divide 7" in text, text

    with pytest.raises(PassError, match="sp=1 found no residual stream"):
        compile_script(_script("mlp.py"), "[0,1]: tp=2 sp=1", 2)

    with pytest.raises(PassError, match=r"sequence parallelism \(sp=1\) across several device groups"):
        compile_script(_script("gpt.py"), "[0,1]: tp=2 sp=1 share=1 | [2,3]: tp=2 share=1", 4)


def test_report_shows_reduce_scatter_where_tp_alone_all_reduces(cli):
    args = ["hspmd", "compile", "examples/gpt.py", "--report", "--set", "model.layers=1", "--set", "model.seq_len=16",
            "--set", "data.batch_size=4"]
    sp = cli(*args, "--strategy", "[0,1]: tp=2 sp=1", check=True).stdout
    tp = cli(*args, "--strategy", "[0,1]: tp=2", check=True).stdout
    fwd = [line.split() for line in sp.splitlines() if "@Block_0_fwd" in line]
    # [B, T, D] = [4, 16, 128]: gathered from / scattered to [4, 8, 128], 16 KiB sent per rank each
    assert sorted((row[0], row[5], row[-2]) for row in fwd) == [
        ("comm.all_gather", "4x8x128", "16,384"), ("comm.all_gather", "4x8x128", "16,384"),
        ("comm.reduce_scatter", "4x16x128", "16,384"), ("comm.reduce_scatter", "4x16x128", "16,384")], fwd
    assert [line.split()[0] for line in tp.splitlines() if "@Block_0_fwd" in line] == ["comm.all_reduce"] * 2
