"""Uneven rows inside a group: `dp=3` over 16 rows, a 9-row share over `dp=2`. The strategy is
evened into groups that split their rows evenly (`even_out_rows`), and training equals one device."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES
from hspmd.compiler import compile_script, write_bundle
from hspmd.dialects.dist import module_strategies
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.layout import apportion
from hspmd.ir.strategy import Strategy, StrategyGroup, even_out_rows
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train

STEPS = 3
SMALL = {
    "mlp.py": ["batch_size=16", "hidden=32"],
    "gpt.py": ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=8",
              "optim.warmup=1"],
}


def _rows_per_rank(strategy: Strategy, rows: int) -> dict[int, int]:
    """Return the rows each device computes (every tp rank of a dp rank computes its rows)."""
    counts = apportion(rows, tuple(g.share for g in strategy.groups)) if len(strategy.groups) > 1 else (rows,)
    out = {}
    for g, r in zip(strategy.groups, counts):
        assert r % g.dp == 0, (str(strategy), r, g.dp)
        for d in g.devices:
            out[d] = r // g.dp
    return out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_evened_strategies_split_evenly_and_keep_every_rows_count(data):
    groups, start = [], 0
    for _ in range(data.draw(st.integers(1, 3))):
        dp, tp = data.draw(st.integers(1, 5)), data.draw(st.sampled_from([1, 2]))
        groups.append(StrategyGroup(tuple(range(start, start + dp * tp)), dp=dp, tp=tp, share=data.draw(st.integers(1, 4))))
        start += dp * tp
    strategy = Strategy(tuple(groups))
    rows = data.draw(st.integers(sum(g.dp for g in groups) * 4, 64))
    counts = apportion(rows, tuple(g.share for g in groups)) if len(groups) > 1 else (rows,)
    if any(r < g.dp for g, r in zip(groups, counts)):
        return
    evened = even_out_rows(strategy, rows)
    assert sorted(evened.devices) == sorted(strategy.devices)
    got = _rows_per_rank(evened, rows)
    for g, r in zip(groups, counts):  # within a group, rows differ by at most one, the first dp ranks more
        per = [got[g.devices[i * g.tp]] for i in range(g.dp)]
        assert sum(per) == r and max(per) - min(per) <= 1 and per == sorted(per, reverse=True)
        assert all(got[d] == got[g.devices[(k // g.tp) * g.tp]] for k, d in enumerate(g.devices))
    if all(r % g.dp == 0 for g, r in zip(groups, counts)):
        assert evened is strategy


def _script(example: str):
    return load_script(os.path.join(EXAMPLES, example), parse_overrides(SMALL[example] + [f"steps={STEPS}"]))


def _train(tmp_path, example: str, strategy: str, n: int):
    bundle = tmp_path / f"{example}-{n}-{abs(hash(strategy))}"
    write_bundle(compile_script(_script(example), strategy, n), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=STEPS, quiet=True), timeout=300)


@pytest.mark.parametrize("example,strategy,n", [
    ("mlp.py", "[0-2]: dp=3", 3),                                   # 16 rows: 6, 5, 5
    ("mlp.py", "[0,1]: dp=2 share=9 | [2]: dp=1 share=7", 3),     # 9 rows over dp=2: 5, 4
    ("gpt.py", "[0-2]: dp=3 zero=1", 3),                            # 8 sequences: 3, 3, 2
    ("gpt.py", "[0-5]: dp=3 tp=2", 6),                              # tp pairs with 3, 3, 2
])
def test_uneven_rows_train_as_one_device(tmp_path, example, strategy, n):
    ref = _train(tmp_path, example, "[0]: dp=1", 1)[0]
    ranks = _train(tmp_path, example, strategy, n)
    for got in ranks:
        np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-4)
    atol = 5e-5 if example == "gpt.py" else 1e-6
    for name, value in ref.params.items():
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-5, atol=atol, err_msg=name)


def test_the_module_records_the_evened_strategy():
    compiled = compile_script(_script("mlp.py"), "[0-2]: dp=3", 3)
    (record,) = module_strategies(compiled.annotated)
    assert str(record.strategy) == "[0]: dp=1 share=3 | [1,2]: dp=2 share=5"  # 16 rows: 6 | 5 + 5


@settings(max_examples=6, deadline=None)
@given(n=st.integers(2, 4), rows=st.integers(2, 13), hetero=st.booleans())
def test_random_uneven_row_counts_give_the_one_device_gradient(tmp_path_factory, n, rows, hetero):
    """Random batch sizes over random dp (and a second group beside): gradients equal one device's."""
    if rows < n:
        return
    strategy = f"[0-{n - 1}]: dp={n}"
    if hetero and rows > n:
        strategy = f"[0-{n - 2}]: dp={n - 1} share=2 | [{n - 1}]: dp=1 share=1"
    counts = apportion(rows, (2, 1)) if "|" in strategy else (rows,)
    if counts[0] < (n - 1 if "|" in strategy else n) or counts[-1] < 1:
        return
    script = load_script(os.path.join(EXAMPLES, "mlp.py"), parse_overrides([f"batch_size={rows}", "hidden=16", "steps=1"]))
    tmp = tmp_path_factory.mktemp("uneven")
    outs = {}
    for s, k in (("[0]: dp=1", 1), (strategy, n)):
        bundle = tmp / f"b{k}"
        write_bundle(compile_script(script, s, k, optimizer=False), str(bundle))
        outs[k] = run_spmd(k, lambda comm, b=str(bundle): train(b, comm, steps=1, quiet=True, keep_outputs=True),
                           timeout=300)
    ref = outs[1][0].outputs[0]
    for got in outs[n]:
        for name, value in ref.items():
            np.testing.assert_allclose(got.outputs[0][name], value, rtol=1e-5, atol=1e-6, err_msg=f"{strategy}: {name}")
