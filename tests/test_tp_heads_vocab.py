"""Tensor parallelism done fully: head-parallel attention and a vocabulary split (Megatron).

* GPT's fused qkv is head-major, so with tp=2 each rank computes the attention of its heads:
  the blocks need only the Megatron all-reduces (forward: one per row-parallel matmul;
  backward: one per column-parallel input, the LM head's included), and nothing gathers qkv;
  no weight gradient is reduced over tp.
* The embedding table is split along the vocabulary (the lookup gives partial sums), the LM
  head along its vocabulary outputs, and the cross-entropy runs on vocabulary-split logits: the
  maxima of the tp pieces are all-gathered ([..., tp] values) and the sum of exponentials and
  the label's logit are all-reduced ([...] values); the logits are never gathered.
* The vocabulary-parallel loss (`vocab_parallel.split_cross_entropy`) and the split lookup
  equal the fused one-device ops in float64 on random layouts over 1-4 in-process ranks.
* Bad input: tp larger than the head count names the weight, the shapes, tp and the rule (a
  head count tp does not divide is split in uneven pieces: tests/test_uneven_tp.py).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdsl.rewriter import Rewriter
from test_spmd_property import _all_states, check_outputs, compile_step, run_step
from test_tensor_parallel import _script

import hspmd as hs
from conftest import EXAMPLES, run_cli
from hspmd.dialects import graph
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.compiler import compile_script
from hspmd.frontend.tracing import Tracer
from hspmd.ir.layout import DUP, DistributedStates, Layout, split
from hspmd.codegen.report import collective_report
from hspmd.transforms.autodiff import Autodiff
from hspmd.compiler import run_passes
from hspmd.transforms.util import PassError
from hspmd.transforms.vocab_parallel import split_cross_entropy

B, T, D, V = 4, 8, 32, 256  # test_tensor_parallel's small GPT/LLaMA


def _rows(example: str, strategy: str = "[0,1]: tp=2", n: int = 2):
    return collective_report(compile_script(_script(example), strategy, n).physical)


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_tp2_collectives_are_megatron_s_and_nothing_gathers_activations(example):
    rows = _rows(example)
    blocks = Counter((r.function, r.op) for r in rows if r.function.startswith("Block_0"))
    assert blocks == Counter({("Block_0_fwd", "comm.all_reduce"): 2, ("Block_0_bwd", "comm.all_reduce"): 2}), blocks
    for r in rows:
        if r.function.startswith("Block_0"):  # one [B, T, D] activation each, per layer
            assert r.shape == (B, T, D) and r.calls == 2, r
    gathers = [r for r in rows if r.op == "comm.all_gather"]
    # the only gather: each rank's maximum of its vocabulary piece, per token
    assert [(r.shape, r.result_shape) for r in gathers] == [((B, T, 1), (B, T, 2))], gathers
    step = Counter((r.op, r.shape) for r in rows if r.function == "train_step" and r.op != "comm.local_split")
    # forward: the vocabulary-split lookup's partial sums ([B, T, D]), the tp maxima, the sum of
    # exponentials and the label's logit ([B, T]); backward: the LM head's input gradient (it is
    # column-parallel); then only the gradient norm's partial sums of squares (scalars). No weight
    # gradient is reduced over tp: the norms' and embeddings' gradients come from whole inputs.
    scalars = step.pop(("comm.all_reduce", ()), 0)
    assert step == Counter({("comm.all_reduce", (B, T, D)): 2, ("comm.all_gather", (B, T, 1)): 1,
                            ("comm.all_reduce", (B, T)): 2}), step
    assert scalars > 0
    assert not any(V // 2 in r.shape or V in r.shape for r in rows if len(r.shape) == 3), "logits moved"


def test_fused_qkv_is_head_major_and_split_by_heads():
    compiled = compile_script(_script("gpt.py"), "[0,1]: tp=2", 2)
    step = next(f for f in compiled.annotated.body.block.ops if f.sym_name.data == "Block_0_fwd")
    reshapes = [o for o in step.body.block.ops if isinstance(o, graph.ReshapeOp)
                and o.result.type.get_shape() == (B, T, 4, 3 * D // 4)]
    assert len(reshapes) == 1  # [B, T, 3D] -> [B, T, H, 3*hd]: the column split lands on H
    assert str(layout_of(reshapes[0].result)) == "[0,1]: split(2)=2"


def test_tp_larger_than_the_head_count_names_weight_numbers_and_rule():
    with pytest.raises(PassError) as err:
        compile_script(_script("gpt.py"), "[0-7]: tp=8", 8)
    text = str(err.value)
    # the layers are stacked: one name for all of them, the shape of each
    assert "tp=8" in text and "4 heads" in text and "'blocks.[0:2].attn.qkv.weight' of shape [32, 96] (each of layers 0 to 1)" in text, text
    assert "leave a tp rank with nothing" in text, text  # fewer heads than tp; 3 heads over tp=2 are uneven pieces


def _layouts(draw, shapes: dict[str, tuple[int, ...]], n: int, fixed: dict[str, DistributedStates]):
    return {leaf: Layout.spmd(range(n), fixed.get(leaf) or draw(st.sampled_from(_all_states(shape, n))))
            for leaf, shape in shapes.items()}


def _trace(build) -> tuple:
    t = Tracer()
    rng = np.random.default_rng(0)
    batch: dict[str, np.ndarray] = {}
    loss = build(t, rng, batch)
    t.output("loss", loss)
    module = t.finish()
    Autodiff().apply(None, module)
    shapes = {op.tensor_name.data: op.result.type.get_shape() for op in module.walk()
              if op.name in ("graph.parameter", "graph.input")}
    return module, shapes, batch


@settings(max_examples=12, deadline=None)
@given(data=st.data(), tp=st.sampled_from([1, 2, 4]), n=st.sampled_from([1, 2, 4]),
       ignore=st.booleans(), classes=st.sampled_from([4, 8]))
def test_vocab_parallel_cross_entropy_equals_the_fused_loss(data, tp, n, ignore, classes):
    def build(t, rng, batch):
        labels = rng.integers(0, classes, size=(4, 2))
        if ignore:
            labels = np.where(rng.random((4, 2)) < 0.3, -100, labels)
            labels[0, 0] = 1
        batch["labels"] = labels
        logits = t.parameter("logits", (4, 2, classes), "normal:3.0", "float64")
        y = t.input("labels", (4, 2), "int64")
        return hs.cross_entropy(logits * logits, y, ignore_index=-100 if ignore else None)

    logical, shapes, batch = _trace(build)
    (ref,) = run_step(compile_step(logical, {k: Layout.replicated((0,)) for k in shapes}), 1, batch)
    (loss,) = [o for o in logical.walk() if isinstance(o, graph.SoftmaxCrossEntropyOp)]
    split_cross_entropy(loss, tp)
    assert not any(isinstance(o, (graph.SoftmaxCrossEntropyOp, graph.SoftmaxCrossEntropyGradOp))
                   for o in logical.walk())
    # as in a tp program: logits split along the classes, labels whole (or any layouts at all)
    fixed = {"logits": DistributedStates.of((split(2), n)), "labels": DistributedStates.of((DUP, n))} \
        if data.draw(st.booleans()) else {}
    layouts = _layouts(data.draw, shapes, n, fixed)
    physical = compile_step(logical, layouts)
    check_outputs(run_step(physical, n, batch), ref, f"tp={tp} on {n} ranks, {layouts}")
    if fixed and tp == n:  # split logits stay split: exp, one_hot and the softmax run on class pieces
        annotated = logical.clone()
        for op in annotated.walk():
            if isinstance(op, (graph.ParameterOp, graph.InputOp)):
                Rewriter.replace_value_with_new_type(op.result, with_layout(op.result.type, layouts[op.tensor_name.data]))
        run_passes(annotated, "propagate-layouts,insert-reshard")
        pieces = [str(layout_of(o.results[0])) for o in annotated.walk() if isinstance(o, (graph.ExpOp, graph.OneHotOp))]
        assert len(pieces) == 3 and set(pieces) == {str(Layout.spmd(range(n), fixed["logits"]))}, pieces


@settings(max_examples=10, deadline=None)
@given(data=st.data(), n=st.sampled_from([2, 4]))
def test_vocabulary_split_lookup_and_table_gradient_equal_one_device(data, n):
    def build(t, rng, batch):
        batch["ids"] = rng.integers(0, 8, size=(4, 2))
        table = t.parameter("table", (8, 4), "normal:1.0", "float64")
        y = hs.embedding(table, t.input("ids", (4, 2), "int64"))
        t.output("y", y)
        return (y * y).sum()

    logical, shapes, batch = _trace(build)
    (ref,) = run_step(compile_step(logical, {k: Layout.replicated((0,)) for k in shapes}), 1, batch)
    physical = compile_step(logical, _layouts(data.draw, shapes, n, {"table": DistributedStates.of((split(0), n))}))
    check_outputs(run_step(physical, n, batch), ref, f"table split over {n} ranks")


@pytest.mark.mpi
def test_llama_tp2_over_mpi_logs_the_single_device_losses(tmp_path):
    small = ["--set", "model.layers=2", "--set", "model.d_model=32", "--set", "model.seq_len=16",
             "--set", "data.batch_size=8"]

    def losses(n: int, strategy: str) -> list[float]:
        log = tmp_path / f"llama-{n}.jsonl"
        run_cli("hspmd", "run", "-n", str(n), os.path.join(EXAMPLES, "llama.py"), "--strategy", strategy,
                "--steps", "20", "--log", str(log), *small, check=True, timeout=600)
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    reference, got = losses(1, "[0]: dp=1"), losses(2, "[0,1]: tp=2")
    assert len(got) == 20
    np.testing.assert_allclose(got, reference, rtol=1e-4)


def test_a_vocabulary_tp_does_not_divide_stays_whole():
    compiled = compile_script(_script("gpt.py", ["model.vocab_size=258"]), "[0-3]: tp=4", 4)
    lay = {o.tensor_name.data: str(layout_of(o.result)) for o in compiled.annotated.walk()
           if isinstance(o, graph.ParameterOp)}
    assert lay["head.weight"] == lay["wte.weight"] == "[0-3]: dup=4"
    assert lay["blocks.[0:2].attn.qkv.weight"] == "[0-3]: split(2)=4"  # each layer split along its dim 1
    ops = {o.name for o in compiled.annotated.walk()}
    assert "graph.softmax_cross_entropy" in ops and "graph.one_hot" not in ops  # the fused loss is kept
