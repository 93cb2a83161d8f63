"""Tensor parallelism (Megatron-style) in `apply-strategy`: same numbers as one device.

MLP, GPT and LLaMA train on `[0,1]: tp=2` and `[0-3]: dp=2 tp=2` with the losses and final
parameters of the 1-device run; the block weights get column/row layouts; the MLP's physical
program has one all-reduce per column/row pair and no all-gather of activations; bad degrees
are refused with one message naming the parameter, its shape, tp and the rule.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import EXAMPLES
from hspmd.dialects import graph
from hspmd.dialects.dist import layout_of
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train
from hspmd.transforms.util import PassError

STEPS = 4
SMALL = {
    "mlp.py": ["batch_size=16", "hidden=32"],
    "gpt.py": ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=4",
              "optim.warmup=1"],
    "llama.py": ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=4",
              "optim.warmup=1"],
}
STRATEGIES = {1: "[0]: dp=1", 2: "[0,1]: tp=2", 4: "[0-3]: dp=2 tp=2"}

_reference: dict[str, object] = {}


def _script(example: str, extra=()):
    return load_script(os.path.join(EXAMPLES, example), parse_overrides(SMALL[example] + [f"steps={STEPS}", *extra]))


def _train(tmp_path, example: str, n: int):
    bundle = tmp_path / f"{example}-{n}"
    write_bundle(compile_script(_script(example), STRATEGIES[n], n), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=STEPS, quiet=True), timeout=300)[0]


def _one_device(tmp_path, example: str):
    if example not in _reference:
        _reference[example] = _train(tmp_path, example, 1)
    return _reference[example]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("example", ["mlp.py", "gpt.py", "llama.py"])
def test_tensor_parallel_equals_one_device(tmp_path, example, n):
    ref = _one_device(tmp_path, example)
    got = _train(tmp_path, example, n)
    print(f"\n{example} {STRATEGIES[n]}: losses {got.losses} (1 device {ref.losses})")
    assert len(got.losses) == STEPS
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-4)
    assert set(got.params) == set(ref.params)
    # Adam normalises its steps: an element whose gradient is at float32 round-off level may move
    # by a good part of lr either way, whichever the summation order; hence the absolute tolerance
    for name, value in ref.params.items():
        np.testing.assert_allclose(got.params[name], value, rtol=1e-4, atol=5e-5, err_msg=name)


def _parameter_layouts(module) -> dict[str, str]:
    return {o.tensor_name.data: str(layout_of(o.result)) for o in module.walk() if isinstance(o, graph.ParameterOp)}


@pytest.mark.parametrize("example, column, row", [
    ("gpt.py", ["attn.qkv.weight", "mlp.fc.weight"], ["attn.proj.weight", "mlp.proj.weight"]),
    ("llama.py", ["attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "mlp.w1.weight", "mlp.w3.weight"],
     ["attn.proj.weight", "mlp.w2.weight"]),
])
def test_block_weights_are_column_then_row_parallel(example, column, row):
    compiled = compile_script(_script(example), "[0-3]: dp=2 tp=2", 4)
    lay = _parameter_layouts(compiled.annotated)
    # the layers stacked (`stack-layers`): each layer's weight laid out as one, the stacking dim 0 whole
    for w in column:
        assert lay[f"blocks.[0:2].{w}"] == "[0-3]: dup=2, split(2)=2", w
        assert lay[f"opt.m.blocks.[0:2].{w}"] == "[0-3]: dup=2, split(2)=2", w  # the state follows
    for w in row:
        assert lay[f"blocks.[0:2].{w}"] == "[0-3]: dup=2, split(1)=2", w
    replicated = [k for k, v in lay.items() if v == "[0-3]: dup=4"]
    assert any("ln" in k or "norm" in k for k in replicated)
    # vocabulary-parallel: the LM head is split along its vocabulary (output) dim, the table along its rows
    assert lay["head.weight"] == "[0-3]: dup=2, split(1)=2"
    assert lay["wte.weight" if example == "gpt.py" else "tok.weight"] == "[0-3]: dup=2, split(0)=2"
    if example == "gpt.py":
        assert lay["blocks.[0:2].attn.qkv.bias"] == "[0-3]: dup=2, split(1)=2"  # a column-parallel bias
        assert lay["blocks.[0:2].mlp.fc.bias"] == "[0-3]: dup=2, split(1)=2"
        assert lay["blocks.[0:2].mlp.proj.bias"] == "[0-3]: dup=4"  # a row-parallel bias
        assert lay["wpe"] == "[0-3]: dup=4"


def _comms(module) -> list[tuple[str, tuple]]:
    return [(o.name, tuple(tuple(g) for g in o.rank_groups)) for o in module.walk() if o.dialect_name() == "comm"]


def test_mlp_collectives_one_all_reduce_per_pair_and_no_activation_gather():
    compiled = compile_script(_script("mlp.py"), "[0,1]: tp=2", 2)
    lay = _parameter_layouts(compiled.annotated)
    assert lay["layers.0.weight"] == "[0,1]: split(1)=2" and lay["layers.0.bias"] == "[0,1]: split(0)=2"
    assert lay["layers.1.weight"] == "[0,1]: split(0)=2" and lay["layers.1.bias"] == "[0,1]: dup=2"
    assert lay["layers.2.weight"] == "[0,1]: dup=2"  # the classifier pairs with nothing
    comms = _comms(compiled.physical)
    # the row-parallel matmul's partial sums, once in the forward; the backward needs none (the
    # column layer's input gradient, which Megatron all-reduces, is the data's and not needed)
    assert comms == [("comm.all_reduce", ((0, 1),))], comms

    compiled = compile_script(_script("mlp.py"), "[0-3]: dp=2 tp=2", 4)
    comms = _comms(compiled.physical)
    assert not any(name == "comm.all_gather" for name, _ in comms), comms
    assert ("comm.all_reduce", ((0, 1), (2, 3))) in comms  # tp pairs: the row-parallel sums
    assert ("comm.all_reduce", ((0, 2), (1, 3))) in comms  # dp replicas: the gradients


def test_llama_block_needs_no_activation_gather():
    compiled = compile_script(_script("llama.py"), "[0,1]: tp=2", 2)
    fwd = [f for f in compiled.physical.walk() if getattr(f, "sym_name", None) is not None
           and f.sym_name.data.startswith("Block_0_fwd")]
    assert fwd
    for f in fwd:
        names = [name for name, _ in _comms(f)]
        assert names == ["comm.all_reduce", "comm.all_reduce"], names  # after attn.proj and mlp.w2


def test_bad_tensor_parallel_degrees_name_parameter_shape_and_rule():
    # a width tp does not divide is split in uneven pieces (tests/test_uneven_tp.py); one narrower
    # than tp would leave a rank with nothing
    with pytest.raises(PassError) as err:
        compile_script(_script("mlp.py", ["hidden=3"]), "[0-3]: tp=4", 4)
    text = str(err.value)
    assert "'layers.0.weight'" in text and "[64, 3]" in text and "tp=4" in text and "output dim 1" in text, text

    script = load_script(os.path.join(EXAMPLES, "llama.py"),
                         parse_overrides(["model.d_model=32", "model.seq_len=8", "model.heads=2", "model.layers=1",
                                          "data.batch_size=4"]))
    with pytest.raises(PassError) as err:
        compile_script(script, "[0-3]: tp=4", 4)
    text = str(err.value)
    assert "tp=4" in text and "2 heads" in text and "attn.w" in text and "[32, 32]" in text, text


def test_zero_in_a_pipelined_group_beside_others_is_refused():
    with pytest.raises(PassError, match="ZeRO .zero=1. in a pipeline beside other device groups"):
        compile_script(_script("mlp.py"), "[0-3]: dp=2 pp=2 zero=1 | [4]: dp=1", 5)
