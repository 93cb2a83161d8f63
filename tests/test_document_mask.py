"""A GPT with `document_mask` keeps attention within the documents of a packed window
(`hs.data`'s `segments`): what one document predicts does not depend on another's tokens."""

from __future__ import annotations

import numpy as np

import hspmd as hs
from hspmd.frontend.nn import bind_parameters
from hspmd.frontend.tracing import Tracer
from hspmd.frontend.transformer import GPT, GPTConfig, lm_loss
from test_ops_grad import compile_plan


def _loss_plan(document_mask: bool):
    cfg = GPTConfig(vocab_size=40, seq_len=8, layers=2, heads=2, d_model=16, document_mask=document_mask)
    model, tracer = GPT(cfg), Tracer()
    with bind_parameters(model, tracer):
        batch = {k: tracer.input(k, (2, 8), "int32") for k in ("ids", "targets")}
        batch["segments"] = tracer.input("segments", (2, 8), "float32")
        tracer.output("loss", lm_loss(model, batch))
    plan = compile_plan(tracer.finish())
    return plan, plan.initial_state(0)


def test_a_document_does_not_see_the_one_before_it_in_its_window():
    docs = [np.arange(1, 5), np.arange(10, 14), np.arange(20, 29)]
    rows = hs.data.tokens(None, documents=docs, vocab_size=40).packed(9).read([0, 1])
    assert rows["segments"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    learn_second = dict(rows, targets=np.where(rows["segments"] == 1, rows["targets"], -100).astype(np.int32))
    other_first = dict(learn_second, ids=learn_second["ids"].copy())
    other_first["ids"][0, :4] = [30, 31, 32, 33]  # another first document, the same second one
    for mask, same in ((True, True), (False, False)):
        plan, state = _loss_plan(mask)
        a = float(plan.run(dict(state), plan.local_batch(learn_second))["loss"])
        b = float(plan.run(dict(state), plan.local_batch(other_first))["loss"])
        assert (a == b) is same, (mask, a, b)
