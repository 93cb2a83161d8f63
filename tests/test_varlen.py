"""Variable-length sequences: token-budget batching into length buckets, one program per bucket.

A bucket's program, compiled at its own sequence length, computes what a program compiled for
the longest length computes on the same batches padded to it (padding is ignored by the loss
and, being after the real positions, unseen by causal attention): the same losses and the same
parameters, step after step, switching programs with the batches' buckets, on 1 and 2 ranks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import EXAMPLES
from hspmd.compiler import compile_strategies, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.runtime.comm.inprocess import run_spmd
from hspmd.data.text import bucket_of, stdlib_documents, token_budget_batches
from hspmd.runtime.worker import train

VARLEN = os.path.join(EXAMPLES, "gpt_varlen.py")
BUCKETS = [16, 32, 64]
SMALL = ["model.d_model=32", "model.seq_len=64", "model.heads=4", "model.layers=2", "data.max_tokens=256",
         "data.documents=40", f"data.buckets={BUCKETS}", "optim.warmup=1"]
STEPS = 8


def test_documents_are_real_and_unequal():
    docs = stdlib_documents()
    lengths = np.array([len(d) for d in docs])
    assert len(docs) > 1000 and lengths.min() >= 16 and np.median(lengths) < 400 < lengths.max()
    assert len({d.tobytes() for d in docs}) == len(docs)


def test_token_budget_batches_keep_every_token_once():
    docs = stdlib_documents()[:60]
    batches = list(token_budget_batches(docs, 512, [32, 64, 128], seed=3))
    want = sorted(d[:129].tobytes() for d in docs)  # each document, truncated to the context + 1
    got = []
    for b in batches:
        rows, length = b["ids"].shape
        assert length in (32, 64, 128) and rows == 512 // length
        for ids, targets in zip(b["ids"], b["targets"]):
            n = int((targets != -100).sum())
            if n:
                assert (targets[n:] == -100).all() and n > (length // 2 if length > 32 else 0)
                assert bucket_of(n, [32, 64, 128]) == [32, 64, 128].index(length)
                got.append(ids[:n].astype(np.uint8).tobytes() + bytes([int(targets[n - 1])]))
    assert sorted(got) == want
    again = list(token_budget_batches(docs, 512, [32, 64, 128], seed=3))
    assert all((a["ids"] == b["ids"]).all() for a, b in zip(batches, again))


def _run(n: int, strategies: list[str], pad_to: int | None, tmp_path) -> list:
    script = load_script(VARLEN, parse_overrides(SMALL + [f"steps={STEPS}", f"data.pad_to={pad_to}"]))
    compiled = compile_strategies(script, strategies, n, configs=[{"data.bucket": b} for b in BUCKETS])
    bundle = write_bundle(compiled, str(tmp_path / f"b{n}-{pad_to}-{len(set(strategies))}"))
    return run_spmd(n, lambda c: train(bundle, c, steps=STEPS, quiet=True), timeout=600)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """Every batch padded to the longest bucket, each bucket's row count compiled once, on one device."""
    return _run(1, ["[0]: dp=1"] * len(BUCKETS), BUCKETS[-1], tmp_path_factory.mktemp("padded"))[0]


def test_buckets_equal_padding_to_the_longest(padded, tmp_path):
    got = _run(1, ["[0]: dp=1"] * len(BUCKETS), None, tmp_path)[0]
    assert got.switches  # the run went through several bucket programs
    np.testing.assert_allclose(got.losses, padded.losses, rtol=1e-5)
    for name, value in padded.params.items():
        np.testing.assert_allclose(got.params[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_buckets_under_their_own_strategies_equal_one_device(padded, tmp_path):
    """Short buckets data-parallel, the longest tensor-parallel, on 2 ranks."""
    ranks = _run(2, ["[0,1]: dp=2", "[0,1]: dp=2", "[0,1]: tp=2"], None, tmp_path)
    assert any(b == 2 or a == 2 for _, a, b, _ in ranks[0].switches)
    for r in ranks:
        np.testing.assert_allclose(r.losses, padded.losses, rtol=1e-5)
    for name, value in padded.params.items():  # AdamW moves a gradient at round-off level by part of lr
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-4, atol=5e-5, err_msg=name)
