"""The strategy as IR data: `#dist.strategy` records on the module, read by the passes after apply-strategy."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES, run_cli
from hspmd.compiler import annotate_passes, compile_script, physical_passes, run_passes
from hspmd.dialects.context import IRTextError, module_text, parse_module
from hspmd.dialects.dist import STRATEGIES_ATTR, module_strategies, record_strategy
from hspmd.frontend.script import load_script
from hspmd.frontend.tracing import Tracer
from hspmd.ir.strategy import PIPELINE_SCHEDULES, StrategyError, StrategyGroup, StrategyRecord, Strategy, parse_strategy
from hspmd.transforms.util import PassError, module_strategy

GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL = {"model.layers": 2, "model.d_model": 32, "model.seq_len": 16, "data.batch_size": 8}


def _empty_module():
    t = Tracer()
    x = t.input("x", (4, 2), "float32")
    t.output("y", x)
    return t.finish()


@st.composite
def records(draw, sid=None):
    n_groups = draw(st.integers(1, 3))
    groups, first = [], 0
    for _ in range(n_groups):
        dp, tp, pp = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
        n = dp * tp * pp
        groups.append(StrategyGroup(tuple(range(first, first + n)), dp=dp, tp=tp, pp=pp,
                                    share=draw(st.integers(1, 4)), zero=draw(st.sampled_from([0, 1, 2]))))
        first += n
    return StrategyRecord(draw(st.integers(0, 9)) if sid is None else sid, Strategy(tuple(groups)),
                          draw(st.integers(1, 8)), draw(st.sampled_from(PIPELINE_SCHEDULES)))


@settings(max_examples=40, deadline=None)
@given(rs=st.lists(records(), min_size=1, max_size=3, unique_by=lambda r: r.id))
def test_strategies_roundtrip_through_ir_text(rs):
    module = _empty_module()
    for r in rs:
        record_strategy(module, r)
    assert module_strategies(module) == tuple(sorted(rs, key=lambda r: r.id))
    text = module_text(module)
    again = parse_module(text)
    assert module_strategies(again) == module_strategies(module)
    assert module_text(again) == text


def test_a_record_with_the_same_id_replaces_the_old_one():
    module = _empty_module()
    record_strategy(module, StrategyRecord(0, parse_strategy("[0,1]: dp=2")))
    record_strategy(module, StrategyRecord(1, parse_strategy("[0,1]: tp=2")))
    record_strategy(module, StrategyRecord(0, parse_strategy("[0,1]: pp=2"), microbatches=2))
    assert [str(r.strategy) for r in module_strategies(module)] == ["[0,1]: dp=1 pp=2", "[0,1]: dp=1 tp=2"]
    assert module_strategy(module, 1).strategy == parse_strategy("[0,1]: tp=2")
    with pytest.raises(PassError, match="records 2 strategies; say which one"):
        module_strategy(module)
    with pytest.raises(PassError, match="needs strategy 7, but the module records 0, 1"):
        module_strategy(module, 7)


def test_a_pass_that_needs_the_strategy_says_so_when_there_is_none():
    with pytest.raises(PassError, match="needs the module's strategy .* run apply-strategy first"):
        module_strategy(_empty_module(), what="apply-annotations")


@pytest.mark.parametrize("text, words", [
    ('#dist.strategy<id = 0, "[0-3]: tp=3", microbatches = 1, schedule = "gpipe">', ["bad strategy", "dp*tp*pp"]),
    ('#dist.strategy<id = 0, "[0,1]: dp=2", microbatches = 0, schedule = "gpipe">', ["micro-batches must be >= 1"]),
    ('#dist.strategy<id = 0, "[0,1]: dp=2", microbatches = 1, schedule = "zigzag">', ["unknown schedule 'zigzag'"]),
    ('#dist.strategy<id = 0, "[0,1]: dp=2", schedule = "gpipe">', ["microbatches"]),
    ('#dist.strategy<0, "[0,1]: dp=2", microbatches = 1, schedule = "gpipe">', ["id"]),
])
def test_bad_strategy_attributes_are_refused_where_they_are(text, words):
    with pytest.raises(IRTextError) as err:
        parse_module(f"builtin.module attributes {{{STRATEGIES_ATTR} = [{text}]}} {{}}")
    message = str(err.value)
    assert all(w in message for w in words) and "^" in message, message


def test_bad_records_are_refused():
    for kwargs, words in [({"id": -1}, "id must be an integer"), ({"microbatches": 0}, "micro-batches"),
                          ({"schedule": "x"}, "unknown schedule")]:
        with pytest.raises(StrategyError, match=words):
            StrategyRecord(**{"id": 0, "strategy": parse_strategy("[0]: dp=1"), **kwargs})


def test_the_compiled_levels_carry_the_strategy_and_passes_read_it():
    compiled = compile_script(load_script(GPT, SMALL), "[0-3]: dp=2 pp=2 zero=1", 4, microbatches=2,
                              pipeline_schedule="1f1b")
    want = StrategyRecord(0, parse_strategy("[0-3]: dp=2 pp=2 zero=1"), 2, "1f1b")
    assert module_strategies(compiled.annotated) == (want,)
    assert module_strategies(compiled.physical) == (want,)
    assert STRATEGIES_ATTR not in module_text(compiled.logical)
    # the passes after apply-strategy take no strategy text: only an id
    later = annotate_passes(want)[1:] + physical_passes(want)
    assert all(not hasattr(p, "strategy") for p in later), [p.name for p in later]
    assert {p.name for p in physical_passes(want)} >= {"specialize-groups", "lower-reshard"}


def test_the_annotated_level_runs_on_from_its_text_alone(tmp_path):
    """`hspmd-opt` can take annotated IR on to physical IR: the strategy is in the text."""
    compiled = compile_script(load_script(GPT, SMALL), "[0,1]: pp=2", 2, microbatches=2)
    path = tmp_path / "annotated.mlir"
    path.write_text(module_text(compiled.annotated))
    spec = ",".join(p.name for p in physical_passes(compiled.strategy))
    proc = run_cli("hspmd-opt", str(path), "-p", spec, check=True, timeout=300)
    assert proc.stdout == module_text(compiled.physical)


def test_passes_after_apply_strategy_refuse_a_module_without_one():
    module = _empty_module()
    with pytest.raises(PassError, match="run apply-strategy first"):
        run_passes(module, "pipeline-split")
