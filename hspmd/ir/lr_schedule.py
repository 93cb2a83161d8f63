"""Learning-rate schedules: pure functions of the step number, fed to the step as input "lr".

Steps count from 1 (the first step is step 1), as the worker numbers them. A schedule is a
`Callable[[int], float]`; a bundle records it as a dict (`config["lr_schedule"]`) that
`schedule_from_spec` turns back into the function:

    {"kind": "constant", "lr": 0.1}
    {"kind": "warmup_cosine", "peak": 3e-4, "warmup_steps": 100, "total_steps": 5000, "min_lr": 3e-5}
    {"kind": "warmup_linear", "peak": 3e-4, "warmup_steps": 100, "total_steps": 5000, "min_lr": 0.0}

Warm-up (both decays): for step s <= W (warmup_steps), lr = peak * s / W, a straight line
from 0 at step 0 to `peak` at step W (so step 1 already trains, with peak / W). After it,
with progress p = (s - W) / (T - W) clipped to [0, 1] (T = total_steps):

    cosine:  lr = min_lr + (peak - min_lr) * (1 + cos(pi * p)) / 2
    linear:  lr = min_lr + (peak - min_lr) * (1 - p)

so step W gives `peak`, step T gives `min_lr`, and every step after T stays at `min_lr`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Schedule = Callable[[int], float]


class ScheduleError(ValueError):
    """A schedule spec or its numbers do not make a schedule; says which and why."""


def constant(lr: float) -> Schedule:
    """Return the schedule that gives `lr` at every step."""
    lr = float(lr)
    return lambda step: lr


def _check(peak: float, warmup_steps: int, total_steps: int, min_lr: float) -> None:
    if not (warmup_steps >= 0 and total_steps > warmup_steps):
        raise ScheduleError(f"needs 0 <= warmup_steps < total_steps, got {warmup_steps} and {total_steps}")
    if not (0 <= min_lr <= peak):
        raise ScheduleError(f"needs 0 <= min_lr <= peak, got min_lr={min_lr} and peak={peak}")


def _progress(step: int, warmup_steps: int, total_steps: int) -> float:
    return min(1.0, max(0.0, (step - warmup_steps) / (total_steps - warmup_steps)))


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> Schedule:
    """Return linear warm-up to `peak` over steps 1..warmup_steps, then cosine decay to `min_lr` at total_steps."""
    _check(peak, warmup_steps, total_steps, min_lr)

    def lr(step: int) -> float:
        if step <= warmup_steps:
            return peak * step / warmup_steps
        p = _progress(step, warmup_steps, total_steps)
        return min_lr + (peak - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))

    return lr


def warmup_linear(peak: float, warmup_steps: int, total_steps: int, min_lr: float = 0.0) -> Schedule:
    """Return linear warm-up to `peak` over steps 1..warmup_steps, then linear decay to `min_lr` at total_steps."""
    _check(peak, warmup_steps, total_steps, min_lr)

    def lr(step: int) -> float:
        if step <= warmup_steps:
            return peak * step / warmup_steps
        return min_lr + (peak - min_lr) * (1.0 - _progress(step, warmup_steps, total_steps))

    return lr


_KINDS: dict[str, tuple[Callable[..., Schedule], tuple[str, ...], tuple[str, ...]]] = {
    # kind: (maker, required keys, optional keys)
    "constant": (constant, ("lr",), ()),
    "warmup_cosine": (warmup_cosine, ("peak", "warmup_steps", "total_steps"), ("min_lr",)),
    "warmup_linear": (warmup_linear, ("peak", "warmup_steps", "total_steps"), ("min_lr",)),
}


def schedule_from_spec(spec: dict) -> Schedule:
    """Return the schedule a spec dict describes (see the module docstring)."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ScheduleError(f"a schedule spec is a dict with a 'kind', got {spec!r}")
    kind = spec["kind"]
    if kind not in _KINDS:
        raise ScheduleError(f"unknown schedule kind '{kind}' (known: {', '.join(_KINDS)})")
    make, required, optional = _KINDS[kind]
    args = {k: v for k, v in spec.items() if k != "kind"}
    missing = [k for k in required if k not in args]
    unknown = [k for k in args if k not in required + optional]
    if missing or unknown:
        raise ScheduleError(
            f"schedule '{kind}' takes {', '.join(required + optional)}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unknown {', '.join(unknown)}" if unknown else "")
        )
    try:
        return make(**args)
    except TypeError as err:
        raise ScheduleError(f"schedule '{kind}': {err}") from None
