"""Strategy text: parsing, defaults, canonical printing, and errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.ir.strategy import Strategy, StrategyError, StrategyGroup, parse_strategy


def test_design_example():
    s = parse_strategy("[0-3]: dp=1 tp=2 pp=2 share=2 | [4,5]: dp=1 tp=2 pp=1 share=1")
    assert s.groups == (StrategyGroup((0, 1, 2, 3), 1, 2, 2, 2), StrategyGroup((4, 5), 1, 2, 1, 1))
    assert str(s) == "[0-3]: dp=1 tp=2 pp=2 share=2 | [4,5]: dp=1 tp=2"
    assert s.devices == (0, 1, 2, 3, 4, 5) and s.num_devices == 6


def test_keys_any_order_commas_and_defaults():
    assert parse_strategy("[0,1]: dp=2").groups == (StrategyGroup((0, 1), dp=2),)
    a = parse_strategy("[0-7]:share=3,pp=2 tp=2,dp=2")
    assert a.groups[0] == StrategyGroup(tuple(range(8)), dp=2, tp=2, pp=2, share=3)
    # a group giving none of dp/tp/pp is pure data parallel
    assert parse_strategy("[0-3]:").groups[0].dp == 4
    assert parse_strategy("[0-3]: share=2").groups[0] == StrategyGroup((0, 1, 2, 3), dp=4, share=2)
    assert parse_strategy("[5,0,1]: tp=3").devices == (5, 0, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 2), st.integers(1, 4)),
                min_size=1, max_size=3), st.randoms(use_true_random=False))
def test_round_trip(degrees, rnd):
    total = sum(dp * tp * pp for dp, tp, pp, _ in degrees)
    ids = list(range(total))
    rnd.shuffle(ids)
    groups, at = [], 0
    for dp, tp, pp, share in degrees:
        n = dp * tp * pp
        groups.append(StrategyGroup(tuple(ids[at:at + n]), dp, tp, pp, share))
        at += n
    s = Strategy(tuple(groups))
    back = parse_strategy(str(s))
    assert back == s and hash(back) == hash(s)
    s.check_devices(total)


@pytest.mark.parametrize("text, line, column, expected", [
    ("[0-3]: dp=2 tq=2", 1, 13, "dp, tp, pp, share, zero, sp, layers, ep, experts, comm, consistency, cache, recompute or device"),
    ("[0-3]: dp=2, dp=2", 1, 14, None),
    ("[0,1]: dp=0 tp=2", 1, 11, "a number >= 1"),
    ("[0,1] dp=2", 1, 7, "':' or '<='"),
    ("[0,1]: dp=2,", 1, 13, "a key (dp, tp, pp, share, zero, sp, layers, ep, experts, comm, consistency, cache, recompute or device)"),
    ("[0,1]: dp=2 |\n [2 3]: dp=1", 2, 5, "',', '-' or ']'"),
    ("[0,1]: dp 2", 1, 11, "'='"),
])
def test_syntax_errors_point_at_the_column(text, line, column, expected):
    with pytest.raises(StrategyError) as info:
        parse_strategy(text)
    err = info.value
    assert (err.line, err.column, err.expected) == (line, column, expected)
    msg = str(err).split("\n")
    assert msg[1] == text.split("\n")[line - 1]
    assert msg[2].index("^") == column - 1
    if expected:
        assert msg[2].endswith("^ expected " + expected)


def test_unknown_key_message():
    with pytest.raises(StrategyError) as info:
        parse_strategy("[0-3]: dp=2 tq=2")
    assert str(info.value) == ("bad strategy at line 1, column 13: unknown key 'tq'\n"
                               "[0-3]: dp=2 tq=2\n"
                               "            ^ expected dp, tp, pp, share, zero, sp, layers, ep, experts, comm, consistency, cache, recompute or device")


def test_semantic_errors():
    with pytest.raises(StrategyError) as info:
        parse_strategy("[0-3]: tp=2")
    assert str(info.value) == ("group '[0-3]: dp=1 tp=2' has dp*tp*pp = 1*2*1 = 2 but 4 devices; the product of "
                               "dp, tp and pp must equal the number of devices (dp=2 would fit)")
    with pytest.raises(StrategyError, match="puts device 1 in more than one group"):
        parse_strategy("[0,1]: dp=2 | [1]: dp=1")
    with pytest.raises(StrategyError, match="must be integers >= 1"):
        StrategyGroup((0,), share=0)
    with pytest.raises(StrategyError, match="distinct device ids"):
        StrategyGroup((0, 0), dp=2)
    with pytest.raises(StrategyError, match="at least one group"):
        Strategy(())
    err = pytest.raises(StrategyError, parse_strategy, "[0-3]: tp=2").value
    assert err.line is None and "\n" not in str(err)


def test_check_devices():
    s = parse_strategy("[0,1]: dp=2")
    s.check_devices(2)
    with pytest.raises(StrategyError) as info:
        s.check_devices(3)
    assert str(info.value) == "strategy '[0,1]: dp=2' uses 2 devices (0-1) but the run has -n 3"
    with pytest.raises(StrategyError, match="uses devices 0,2 but the run has -n 3, which needs devices 0-2"):
        parse_strategy("[0,2]: dp=2").check_devices(3)


def test_sequence_parallel_and_stage_layers():
    assert str(parse_strategy("[0-3]: sp=1 tp=2 dp=2")) == "[0-3]: dp=2 tp=2 sp=1"
    s = parse_strategy("[0,1]: layers=3:1")
    assert (s.groups[0].pp, s.groups[0].layers) == (2, (3, 1))
    assert str(parse_strategy(str(s))) == str(s) == "[0,1]: dp=1 pp=2 layers=3:1"
    with pytest.raises(StrategyError, match="needs tp > 1"):
        parse_strategy("[0,1]: dp=2 sp=1")
    with pytest.raises(StrategyError, match="one count >= 1 per pipeline stage"):
        parse_strategy("[0,1]: pp=2 layers=1:1:1")
    with pytest.raises(StrategyError, match="takes one number, not a list"):
        parse_strategy("[0,1]: dp=2:1")
    with pytest.raises(StrategyError, match="at least one layer"):
        parse_strategy("[0,1]: pp=2 layers=0:2")


def test_device_key_parses_prints_and_round_trips():
    text = "[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu share=1"
    s = parse_strategy(text)
    assert [g.device for g in s.groups] == ["cuda", "cpu"]
    assert str(s) == "[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu"
    assert parse_strategy(str(s)) == s
    assert parse_strategy("[0,1]: tp=2 device=cuda").groups[0].device == "cuda"
    assert parse_strategy("[0,1]: tp=2").groups[0].device is None  # the run's --device decides


@pytest.mark.parametrize("text, message, expected", [
    ("[0]: device=gpu", "device=gpu is not a kind of device", "cpu, cuda"),
    ("[0]: device=3", "key 'device' takes a word, not 3", "cpu, cuda"),
    ("[0]: device=cuda:1", "device=cuda: is not a kind of device", "cpu, cuda"),
])
def test_device_key_errors(text, message, expected):
    with pytest.raises(StrategyError) as info:
        parse_strategy(text)
    assert message in str(info.value) and info.value.expected == expected
    with pytest.raises(StrategyError, match="device must be one of cpu, cuda"):
        StrategyGroup((0,), device="tpu")
