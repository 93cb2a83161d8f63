"""ZeRO optimizer-state sharding (`zero=1`/`zero=2`, pass `shard-optimizer-state`): same numbers as one device.

MLP (Adam) and GPT (AdamW with gradient clipping) train on `[0-3]: dp=4 zero=2` and
`[0-3]: dp=2 tp=2 zero=1` with the losses, final parameters and optimizer moments (checkpoint,
assembled from the ranks' shards) of the 1-device run; the states are split over the dp mesh
axis only; the MLP's gradients become reduce-scatters and its updated shards all-gathers;
the strategy text with `zero` round-trips and a bad stage gets a caret error. Inside pipeline
stages (`[0-3]: dp=2 pp=2 zero=1`, pass `shard-stage-optimizer`) the states are split over each
stage's dp ranks, the gradients reduce-scattered, and the numbers are one device's too.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

import hspmd as hs
from conftest import EXAMPLES
from hspmd.dialects import graph
from hspmd.dialects.dist import layout_of
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.strategy import StrategyError, StrategyRecord, parse_strategy
from hspmd.codegen.report import collective_report
from hspmd.runtime.checkpoint import load_checkpoint
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train
from hspmd.compiler import annotate_passes

STEPS = 3
SMALL = {
    "mlp.py": ["batch_size=16", "hidden=32"],
    "gpt.py": ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=4",
               "optim.warmup=1"],
}
DP4, DP2TP2 = "[0-3]: dp=4 zero=2", "[0-3]: dp=2 tp=2 zero=1"

_reference: dict[str, object] = {}


def _compile(example: str, strategy: str, n: int = 4, **kw):
    script = load_script(os.path.join(EXAMPLES, example), parse_overrides(SMALL[example] + [f"steps={STEPS}"]))
    # the MLP script has plain SGD (no state): give it Adam
    return compile_script(script, strategy, n, optimizer=hs.optim.Adam(1e-2) if example == "mlp.py" else True, **kw)


def _train(tmp_path, example: str, strategy: str, n: int, **kw):
    tag = f"{example}-{n}-{strategy.replace(' ', '').replace(':', '').replace('[', '').replace(']', '')}"
    tag += "".join(f"-{v}" for v in kw.values())
    bundle, ckpt = tmp_path / tag, tmp_path / f"{tag}.npz"
    write_bundle(_compile(example, strategy, n, **kw), str(bundle))
    result = run_spmd(n, lambda comm: train(str(bundle), comm, steps=STEPS, quiet=True, checkpoint=str(ckpt)),
                      timeout=300)[0]
    return result, load_checkpoint(str(ckpt))[0]


def _one_device(tmp_path, example: str):
    if example not in _reference:
        _reference[example] = _train(tmp_path, example, "[0]: dp=1", 1)
    return _reference[example]


def _layouts(module) -> dict[str, str]:
    return {o.tensor_name.data: str(layout_of(o.result)) for o in module.walk() if isinstance(o, graph.ParameterOp)}


@pytest.mark.parametrize("example, strategy, n, kw", [
    *[(example, strategy, 4, {}) for example in ("mlp.py", "gpt.py") for strategy in (DP4, DP2TP2)],
    # inside pipeline stages (`shard-stage-optimizer`), with and without micro-batches
    ("gpt.py", "[0-3]: dp=2 pp=2 zero=1", 4, {"microbatches": 2}),
    ("mlp.py", "[0-3]: dp=2 pp=2 zero=2", 4, {}),
    ("gpt.py", "[0-7]: dp=2 tp=2 pp=2 zero=1", 8, {"microbatches": 2, "pipeline_schedule": "1f1b"}),
])
def test_zero_equals_one_device(tmp_path, example, strategy, n, kw):
    ref, ref_ckpt = _one_device(tmp_path, example)
    got, ckpt = _train(tmp_path, example, strategy, n, **kw)
    print(f"\n{example} {strategy}: losses {got.losses} (1 device {ref.losses})")
    assert len(got.losses) == STEPS
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-4)
    assert set(got.params) == set(ref.params)
    # Adam normalises its steps (see test_tensor_parallel): an absolute tolerance for round-off gradients
    for name, value in ref.params.items():
        np.testing.assert_allclose(got.params[name], value, rtol=1e-4, atol=5e-5, err_msg=name)
    moments = [k for k in ref_ckpt if k.startswith("opt.m.")]
    assert moments and set(ckpt) == set(ref_ckpt)
    for name in moments:  # assembled from the ranks' shards by the states' layouts
        np.testing.assert_allclose(ckpt[name], ref_ckpt[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_states_split_over_dp_only():
    lay = _layouts(_compile("mlp.py", DP4).annotated)
    assert lay["layers.0.weight"] == "[0-3]: dup=4"  # parameters stay as they are
    assert lay["opt.m.layers.0.weight"] == lay["opt.v.layers.0.weight"] == "[0-3]: split(0)=4"
    assert lay["opt.m.layers.2.weight"] == "[0-3]: split(0)=4"  # [32, 10]: dim 0
    assert lay["opt.m.layers.2.bias"] == "[0-3]: dup=4"  # [10]: dp=4 divides no dim, stays replicated
    assert lay["opt.step"] == lay["opt.beta1_pow"] == "[0-3]: dup=4"

    lay = _layouts(_compile("mlp.py", DP2TP2).annotated)
    assert lay["layers.0.weight"] == "[0-3]: dup=2, split(1)=2"  # column-parallel parameter unchanged
    assert lay["opt.m.layers.0.weight"] == "[0-3]: split(0)=2, split(1)=2"  # dp on dim 0, tp as the parameter
    assert lay["opt.m.layers.1.weight"] == "[0-3]: split(1)=2, split(0)=2"  # row-parallel: dp on dim 1
    assert lay["opt.m.layers.0.bias"] == "[0-3]: dup=2, split(0)=2"  # its only dim is tp's: kept
    assert lay["opt.m.layers.2.weight"] == "[0-3]: split(0)=2, dup=2"  # replicated parameter: dp major


def _comms(module) -> Counter:
    return Counter((o.name, tuple(tuple(g) for g in o.rank_groups)) for o in module.walk()
                   if o.dialect_name() == "comm" and hasattr(o, "rank_groups"))


def test_mlp_gradients_reduce_scatter_and_updates_all_gather():
    dp = ((0, 1, 2, 3),)
    base = _comms(_compile("mlp.py", "[0-3]: dp=4").physical)
    assert base == Counter({("comm.all_reduce", dp): 7}), base  # 6 gradients + the loss
    zero = _comms(_compile("mlp.py", DP4).physical)
    # 5 sharded parameters: reduce-scatter of the gradient, slice of the parameter, all-gather of the
    # update; all-reduces are left for the [10] bias (not sharded) and the loss
    assert zero == Counter({("comm.reduce_scatter", dp): 5, ("comm.local_split", dp): 5,
                            ("comm.all_gather", dp): 5, ("comm.all_reduce", dp): 2}), zero
    assert _comms(_compile("mlp.py", "[0-3]: dp=4 zero=1").physical) == zero  # zero=1 compiles alike

    pairs = ((0, 2), (1, 3))  # with tp the dp collectives run over the dp replicas only
    zero = _comms(_compile("mlp.py", DP2TP2).physical)
    assert zero[("comm.reduce_scatter", pairs)] == 5 and zero[("comm.all_gather", pairs)] == 5, zero
    assert zero[("comm.all_reduce", pairs)] == 2, zero
    assert not any(name == "comm.reduce_scatter" and g != pairs for name, g in zero), zero


def test_gpt_with_clipping_reduce_scatters_every_sharded_gradient():
    compiled = _compile("gpt.py", DP4)
    lay = _layouts(compiled.annotated)
    sharded = [k for k, v in lay.items() if k.startswith("opt.m.") and "split" in v]
    assert len(sharded) == len([k for k in lay if k.startswith("opt.m.")])  # every GPT dim here divides by 4
    comms = _comms(compiled.physical)
    dp = ((0, 1, 2, 3),)
    # clip-grad-norm needs the whole gradient's norm: each gradient is reduce-scattered like its state,
    # each rank squares its shard and only the scalar norm is all-reduced (with the loss); no gradient
    # is all-reduced whole; the updated shards are all-gathered
    assert comms[("comm.reduce_scatter", dp)] == len(sharded), comms
    assert comms[("comm.all_reduce", dp)] == 2, comms
    assert comms[("comm.all_gather", dp)] == len(sharded), comms


def test_strategy_text_with_zero():
    for text in [DP4, DP2TP2, "[0-3]: dp=4 zero=1", "[0,1]: dp=2 share=2 zero=1 | [2]: dp=1"]:
        s = parse_strategy(text)
        assert parse_strategy(str(s)) == s and str(s) == text
    assert str(parse_strategy("[0-3]: dp=4 zero=0")) == "[0-3]: dp=4" and parse_strategy("[0-3]: zero=2").groups[0].dp == 4
    with pytest.raises(StrategyError) as err:
        parse_strategy("[0-3]: dp=4 zero=4")
    text = str(err.value)
    assert "column 18" in text and "zero=4" in text and "^" in text and "0, 1, 2 or 3" in text, text
    names = lambda text: [p.name for p in annotate_passes(StrategyRecord(0, parse_strategy(text)))]  # noqa: E731
    assert "shard-optimizer-state" in names(DP4)
    assert "shard-optimizer-state" not in names("[0-3]: dp=4")


@pytest.mark.parametrize("example, strategy, n", [
    ("mlp.py", "[0,1]: dp=2 zero=1 | [2,3]: dp=2", 4),  # only the first group shards its states
    ("gpt.py", "[0,1]: dp=2 share=1 zero=1 | [2]: dp=1 share=1", 3),
    ("gpt.py", "[0,1]: dp=2 zero=2 | [2,3]: dp=2 zero=2", 4),
])
def test_zero_in_heterogeneous_groups_equals_one_device(tmp_path, example, strategy, n):
    ref, ref_ckpt = _one_device(tmp_path, example)
    got, ckpt = _train(tmp_path, example, strategy, n)
    np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-4)
    for name, value in ref.params.items():
        np.testing.assert_allclose(got.params[name], value, rtol=1e-4, atol=5e-5, err_msg=name)
    for name in (k for k in ref_ckpt if k.startswith("opt.m.")):
        np.testing.assert_allclose(ckpt[name], ref_ckpt[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_zero_in_matched_groups_reduce_scatters_then_sums_across_them():
    """Groups alike: each reduce-scatters inside, then the slices are summed across the groups, so
    a rank sends what it would without ZeRO; each group's states are split over its own dp."""
    plain = _compile("mlp.py", "[0,1]: dp=2 | [2,3]: dp=2", 4).physical
    zero = _compile("mlp.py", "[0,1]: dp=2 zero=1 | [2,3]: dp=2 zero=1", 4).physical
    lay = _layouts(_compile("mlp.py", "[0,1]: dp=2 zero=1 | [2,3]: dp=2 zero=1", 4).annotated)
    assert lay["opt.m.layers.0.weight"] == "[0,1]: split(0)=2 | [2,3]: split(0)=2 ; hetero=dup"
    kinds = Counter(name for name, _ in _comms(zero).elements())
    assert kinds["comm.reduce_scatter"] == kinds["comm.all_gather"] > 0
    across = _comms(zero)[("comm.all_reduce", ((0, 2), (1, 3)))]  # the slices' sums across the groups
    assert across >= kinds["comm.reduce_scatter"] // 2, _comms(zero)
    sent = {name: sum(r.bytes_per_step for r in collective_report(m)) for name, m in (("plain", plain), ("zero", zero))}
    assert sent["zero"] <= sent["plain"] * 1.01, sent


def test_pipeline_stages_shard_their_states_over_their_dp_ranks():
    plain = _compile("gpt.py", "[0-3]: dp=2 pp=2", 4, microbatches=2).physical
    zero = _compile("gpt.py", "[0-3]: dp=2 pp=2 zero=1", 4, microbatches=2).physical
    stage0 = ((0, 1),)
    lay = {o.tensor_name.data: str(layout_of(o.properties["global_type"])) for o in zero.walk()
           if isinstance(o, graph.ParameterOp)}
    assert lay["wte.weight"] == "[0,1]: dup=2" and lay["opt.m.wte.weight"] == "[0,1]: split(0)=2"
    assert lay["head.weight"] == "[2,3]: dup=2" and lay["opt.v.head.weight"] == "[2,3]: split(0)=2"
    before, after = _comms(plain), _comms(zero)
    grads = before[("comm.all_reduce", stage0)]  # the gradients' all-reduces over stage 0's dp ranks
    assert after[("comm.reduce_scatter", stage0)] == grads == after[("comm.all_gather", stage0)]
    assert after[("comm.all_reduce", stage0)] == 1  # the gradient norm's partial sum, before the clip
    assert all("split" in text for name, text in lay.items() if name.startswith("opt.m."))
