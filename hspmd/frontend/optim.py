"""Optimizers for model scripts, as `hs.optim`: `SGD`, `Adam`, `AdamW`, and lr schedules.

A model script may define `optimizer(config)` returning one of these (the default is
`SGD(config["lr"])`):

    def optimizer(config):
        return hs.optim.AdamW(config["lr"], weight_decay=0.1, clip_grad_norm=1.0,
                              schedule=hs.optim.WarmupCosine(100, config["steps"], min_lr=3e-5))

An optimizer is a description, not a runtime object: `pipeline()` gives the passes that
write its update into the step's IR (`clip-grad-norm{max_norm=1.0},adam{...}`), and
`schedule_spec()` the learning-rate schedule that the bundle records and the runtime feeds
as the step input "lr" (see `hspmd.ir.lr_schedule`). Arguments and defaults are PyTorch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "WarmupCosine", "WarmupLinear"]


def pass_float(x: float) -> str:
    """Return `x` as a pass-option float (`1.0e-08`: the option parser needs a '.')."""
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{x} is not a finite number")
    text = repr(x)
    if "." not in text:
        mantissa, _, exp = text.partition("e")
        text = f"{mantissa}.0" + (f"e{exp}" if exp else "")
    return text


def _options(**values) -> str:
    parts = []
    for key, value in values.items():
        parts.append(f"{key}={'true' if value else 'false'}" if isinstance(value, bool) else f"{key}={pass_float(value)}")
    return "{" + " ".join(parts) + "}"


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up from 0 to the optimizer's lr over `warmup_steps`, cosine decay to `min_lr` at `total_steps`."""

    warmup_steps: int
    total_steps: int
    min_lr: float = 0.0

    def spec(self, peak: float) -> dict:
        return {"kind": "warmup_cosine", "peak": float(peak), "warmup_steps": int(self.warmup_steps),
                "total_steps": int(self.total_steps), "min_lr": float(self.min_lr)}


@dataclass(frozen=True)
class WarmupLinear:
    """Linear warm-up from 0 to the optimizer's lr over `warmup_steps`, linear decay to `min_lr` at `total_steps`."""

    warmup_steps: int
    total_steps: int
    min_lr: float = 0.0

    def spec(self, peak: float) -> dict:
        return {"kind": "warmup_linear", "peak": float(peak), "warmup_steps": int(self.warmup_steps),
                "total_steps": int(self.total_steps), "min_lr": float(self.min_lr)}


@dataclass(frozen=True)
class Optimizer:
    """What every optimizer has: a (peak) learning rate, optional clipping and schedule.

    `clip_grad_norm`: clip the gradients' global 2-norm to this before the update, as
    `torch.nn.utils.clip_grad_norm_` does (None or 0: no clipping). `schedule`: None for a
    constant lr, or a `WarmupCosine` / `WarmupLinear` whose peak is `lr`.
    """

    lr: float
    clip_grad_norm: float | None = field(default=None, kw_only=True)
    schedule: WarmupCosine | WarmupLinear | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        from hspmd.ir.lr_schedule import schedule_from_spec

        _check(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        if self.clip_grad_norm is not None:
            _check(self.clip_grad_norm >= 0, f"clip_grad_norm must be >= 0 (0: no clipping), got {self.clip_grad_norm}")
        if self.schedule is not None:
            _check(isinstance(self.schedule, (WarmupCosine, WarmupLinear)),
                   f"schedule must be WarmupCosine, WarmupLinear or None, got {self.schedule!r}")
            schedule_from_spec(self.schedule_spec())  # raises ScheduleError (a ValueError) if it makes no sense

    def schedule_spec(self) -> dict:
        """Return the lr schedule as the dict `hspmd.ir.lr_schedule.schedule_from_spec` reads."""
        if self.schedule is None:
            return {"kind": "constant", "lr": float(self.lr)}
        return self.schedule.spec(self.lr)

    def passes(self) -> list[tuple[str, dict]]:
        """Return the passes (name, options) that write clipping and this optimizer's update after `autodiff`."""
        clip = [("clip-grad-norm", {"max_norm": self.clip_grad_norm})] if self.clip_grad_norm else []
        return [(name, {k: v if isinstance(v, bool) else float(v) for k, v in options.items()})
                for name, options in (*clip, self._update_pass())]

    def pipeline(self) -> str:
        """Return `passes()` as pass-spec text (`clip-grad-norm{max_norm=1.0},adam{...}`), as `hspmd-opt -p` reads it."""
        return ",".join(name + _options(**options) for name, options in self.passes())

    def _lr_options(self) -> dict:
        # a constant lr is baked into the IR; a schedule needs the per-step input "lr"
        return {"lr_input": True} if self.schedule is not None else {"lr": self.lr}

    def _update_pass(self) -> tuple[str, dict]:
        raise NotImplementedError


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class SGD(Optimizer):
    """torch.optim.SGD (dampening 0): momentum, Nesterov momentum, L2 weight decay."""

    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.momentum >= 0, f"momentum must be >= 0, got {self.momentum}")
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        _check(not self.nesterov or self.momentum > 0, "Nesterov momentum needs a momentum > 0")

    def _update_pass(self) -> tuple[str, dict]:
        opts = {**self._lr_options(), "momentum": self.momentum, "weight_decay": self.weight_decay}
        if self.nesterov:
            opts["nesterov"] = True
        return "sgd", opts


@dataclass(frozen=True)
class Adam(Optimizer):
    """torch.optim.Adam: `weight_decay` is an L2 penalty added to the gradient."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    decoupled = False  # AdamW sets it: decay the weights, not the gradient

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas must be two numbers in [0, 1), got {self.betas}")
        _check(self.eps >= 0, f"eps must be >= 0, got {self.eps}")
        _check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")

    def _update_pass(self) -> tuple[str, dict]:
        beta1, beta2 = self.betas
        opts = {**self._lr_options(), "beta1": beta1, "beta2": beta2, "eps": self.eps, "weight_decay": self.weight_decay}
        if self.decoupled:
            opts["decoupled"] = True
        return "adam", opts


@dataclass(frozen=True)
class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay `param *= 1 - lr * weight_decay` (default 0.01)."""

    weight_decay: float = 0.01

    decoupled = True
