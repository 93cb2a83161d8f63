"""Dynamic loss scaling's settings and its arithmetic: PyTorch's `torch.amp.GradScaler`.

The scale S multiplies the loss before the backward (float16 gradients stay in range) and
the gradients are multiplied by 1/S after it. Each step:

- found_inf: some gradient element, on any rank, is inf or nan;
- found_inf: the step's update is skipped (parameters and optimizer state unchanged),
  S *= backoff_factor and the count of good steps goes back to 0;
- else the update runs and the count grows by one; when it reaches `growth_interval`,
  S *= growth_factor (where the product is finite) and the count goes back to 0.

The scale and the count are training state (`opt.loss_scale`, `opt.loss_scale_good_steps`,
float32 0-d parameters), so checkpoints keep them. This module is pure: the passes
(`autodiff{dynamic_scale=true}`, `dynamic-loss-scale`) and the script's config read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: the state holding the current scale, and the one counting the steps since the last change
SCALE_STATE = "opt.loss_scale"
GOOD_STEPS_STATE = "opt.loss_scale_good_steps"

#: torch.amp.GradScaler's defaults
INIT_SCALE = 65536.0
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000
#: the good-steps count is a float32 state: exact up to 2**24
MAX_GROWTH_INTERVAL = 2**24


@dataclass(frozen=True)
class DynamicScaling:
    """The settings of dynamic loss scaling (PyTorch's GradScaler defaults)."""

    init_scale: float = INIT_SCALE
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL

    def __post_init__(self) -> None:
        check_settings(self.init_scale, self.growth_factor, self.backoff_factor, self.growth_interval)


def check_settings(init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    """Raise ValueError naming the first setting out of range."""
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"init_scale={init_scale!r}: expected a finite number > 0")
    if not (math.isfinite(growth_factor) and growth_factor > 1):
        raise ValueError(f"growth_factor={growth_factor!r}: expected a finite number > 1")
    if not 0 < backoff_factor < 1:
        raise ValueError(f"backoff_factor={backoff_factor!r}: expected a number in (0, 1)")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or not (
        1 <= growth_interval <= MAX_GROWTH_INTERVAL
    ):
        raise ValueError(f"growth_interval={growth_interval!r}: expected a whole number in [1, {MAX_GROWTH_INTERVAL}]")


def next_scale(scale: float, good_steps: float, finite: bool, growth_factor: float, backoff_factor: float,
               growth_interval: int, dtype) -> tuple[float, float]:
    """Return (scale', good_steps') after a step whose gradients were `finite` (or not), with the
    products rounded to `dtype` (a NumPy float type) as the state holds them."""
    with np.errstate(over="ignore"):  # a product past the dtype's range is inf, and not taken
        if not finite:
            return float(dtype(scale * backoff_factor)), 0.0
        grown = float(dtype(scale * growth_factor))
    good = good_steps + 1.0
    if good >= growth_interval:
        return (grown if math.isfinite(grown) else scale), 0.0
    return scale, good
