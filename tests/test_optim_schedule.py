"""Learning-rate schedules at their boundaries, their specs, and the worker's per-step inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hspmd.frontend.optim import SGD, AdamW, WarmupCosine, WarmupLinear
from hspmd.ir.lr_schedule import ScheduleError, constant, schedule_from_spec, warmup_cosine, warmup_linear
from hspmd.runtime.worker import RunError, step_inputs


def test_constant_is_constant():
    lr = constant(0.25)
    assert [lr(s) for s in (1, 2, 10_000)] == [0.25, 0.25, 0.25]


def test_warmup_cosine_at_its_boundaries():
    lr = warmup_cosine(1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert lr(1) == pytest.approx(0.1)  # step 1 is the first: 1/10 of the peak
    assert lr(5) == pytest.approx(0.5)
    assert lr(10) == 1.0  # the peak at the end of warm-up
    assert lr(11) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 100)))
    assert lr(60) == pytest.approx(0.55)  # half way: the middle of peak and min_lr
    assert lr(110) == pytest.approx(0.1)  # min_lr at total_steps
    assert lr(111) == lr(10_000) == pytest.approx(0.1)  # and after it
    decay = [lr(s) for s in range(10, 120)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_warmup_cosine_without_warmup_starts_decaying_at_step_1():
    lr = warmup_cosine(2.0, warmup_steps=0, total_steps=4)
    assert [lr(s) for s in (1, 2, 3, 4)] == pytest.approx(
        [1 + math.cos(math.pi / 4), 1.0, 1 + math.cos(3 * math.pi / 4), 0.0]
    )


def test_warmup_linear_at_its_boundaries():
    lr = warmup_linear(1.0, warmup_steps=4, total_steps=8, min_lr=0.2)
    assert [lr(s) for s in range(1, 10)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])


@pytest.mark.parametrize(
    "args",
    [dict(warmup_steps=10, total_steps=10), dict(warmup_steps=-1, total_steps=10), dict(warmup_steps=0, total_steps=5, min_lr=2.0)],
)
def test_schedules_reject_numbers_that_make_no_schedule(args):
    for make in (warmup_cosine, warmup_linear):
        with pytest.raises(ScheduleError):
            make(1.0, **args)


def test_frontend_specs_round_trip():
    opt = AdamW(3e-4, schedule=WarmupCosine(100, 5000, min_lr=3e-5))
    spec = opt.schedule_spec()
    assert spec == {"kind": "warmup_cosine", "peak": 3e-4, "warmup_steps": 100, "total_steps": 5000, "min_lr": 3e-5}
    assert schedule_from_spec(spec)(100) == 3e-4
    assert schedule_from_spec(SGD(0.1).schedule_spec())(7) == 0.1
    linear = SGD(0.1, schedule=WarmupLinear(0, 10)).schedule_spec()
    assert schedule_from_spec(linear)(10) == 0.0


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"kind": "step_decay"}, "unknown schedule kind"),
        ({"lr": 0.1}, "with a 'kind'"),
        ({"kind": "warmup_cosine", "peak": 1.0, "warmup_steps": 1}, "missing total_steps"),
        ({"kind": "constant", "lr": 0.1, "gamma": 0.5}, "unknown gamma"),
        ({"kind": "warmup_linear", "peak": "high", "warmup_steps": 1, "total_steps": 3}, "warmup_linear"),
    ],
)
def test_bad_specs_say_why(spec, message):
    with pytest.raises(ScheduleError, match=message):
        schedule_from_spec(spec)


def test_frontend_rejects_a_schedule_that_makes_no_sense():
    with pytest.raises(ValueError, match="warmup_steps < total_steps"):
        AdamW(1e-3, schedule=WarmupCosine(10, 5))


def test_step_inputs_feed_what_the_program_reads():
    config = {"lr_schedule": {"kind": "warmup_linear", "peak": 1.0, "warmup_steps": 2, "total_steps": 4}}
    assert step_inputs(1, config, {"x", "y"}) == {}
    out = step_inputs(1, config, {"x", "lr", "step"})
    assert out["lr"].dtype == np.float64 and float(out["lr"]) == 0.5
    assert out["step"].dtype == np.int64 and int(out["step"]) == 1
    assert float(step_inputs(3, config, {"lr"})["lr"]) == 0.5
    assert float(step_inputs(9, {"lr": 0.3}, {"lr"})["lr"]) == 0.3  # no schedule: the config's lr
    with pytest.raises(RunError, match="neither 'lr_schedule' nor 'lr'"):
        step_inputs(1, {}, {"lr"})
    with pytest.raises(RunError, match="lr_schedule"):
        step_inputs(1, {"lr_schedule": {"kind": "nope"}}, {"lr"})
