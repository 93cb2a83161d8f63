"""Models nobody here wrote: hypothesis strategies that draw transformer models and the strategies
to train them under, and the check every pair must pass.

`model_specs()` draws a spec of `tests/generated_model.py` (a model script written as users
write `hs.nn` models, in the families they write: decoder or encoder, causal or not, heads that
tp may not divide, head dims, MLP widths and gated MLPs, LayerNorm or RMSNorm, pre- or
post-norm, tied or untied embeddings, LM heads and pooled classifiers, mixture-of-experts
layers, dropout, 1-4 layers). `parallel_strategies(spec)` draws how to train it: dp, tp, sp,
pp (micro-batches, GPipe or 1F1B, layer counts per stage), zero, recompute, ep, unlike device groups with
uneven shares, uneven rows, tp that does not divide the heads or widths, on 2 to 4 devices.

`check_pair(spec, strategy, ...)` compiles the pair and trains it for `STEPS` steps on the
in-process communicator: it must give the 1-device losses within 1e-4, or be refused by the
strategy checks (parsing the strategy, `apply-strategy`, `apply-annotations`) with one message
naming what does not fit. A failure in any pass after them is the compiler's
(`hspmd.compiler.InternalError`), and so is a refusal that is not one line, or a run that
fails or differs: each raises `PairFailed`, whose message holds everything needed to run the
pair again (`python tools/random_model_sweep.py --spec ... --strategy ...`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from hspmd.compiler import InternalError, compile_script, write_bundle
from hspmd.frontend.script import load_script
from hspmd.ir.strategy import StrategyError
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train
from hspmd.transforms.util import PassError

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "generated_model.py")
STEPS = 3
#: the losses of N devices against 1: |a - b| <= ATOL + RTOL * |b| (float32 sums in another order)
RTOL, ATOL = 1e-4, 1e-5
#: words of which a refusal must name one: what of the strategy or the model does not fit
REASON_WORDS = ("dp=", "tp=", "pp=", "sp=", "ep=", "zero=", "share", "experts", "microbatches", "layers",
                "heads", "strategy", "devices", "group")


# ----------------------------------------------------------------------------- models


@st.composite
def model_specs(draw, max_layers: int = 4) -> dict:
    """Draw a spec of `generated_model.py`: a small transformer of one of the families users write."""
    kind = draw(st.sampled_from(["decoder", "decoder", "encoder"]))
    heads = draw(st.integers(1, 6))
    head_dim = draw(st.sampled_from([2, 4, 6, 8]))
    positions = draw(st.sampled_from(["learned", "rope", "none"]))
    d_model = draw(st.sampled_from([8, 12, 16, 20, 24]))
    mlp = draw(st.sampled_from(["gelu", "relu", "swiglu", "geglu"]))
    ratio = draw(st.sampled_from([1.0, 1.5, 2.0, 8 / 3, 4.0]))
    layers = draw(st.integers(1, max_layers))
    moe = sorted(draw(st.sets(st.integers(0, layers - 1), max_size=layers))) if draw(st.integers(0, 4)) == 0 else []
    experts = draw(st.sampled_from([2, 4]))
    spec = {
        "kind": kind,
        "causal": kind == "decoder" or draw(st.booleans()),
        "vocab": draw(st.sampled_from([16, 24, 30, 32])),
        "seq": draw(st.sampled_from([4, 6, 8])),
        "batch": draw(st.sampled_from([4, 6, 8, 12])),
        "d_model": d_model,
        "heads": heads,
        "head_dim": head_dim,
        "qkv": draw(st.sampled_from(["separate", "flat", "head-major"])),
        "bias": draw(st.booleans()),
        "rows": draw(st.integers(0, 3)) == 0,
        "mlp": mlp,
        "d_ff": max(2, int(round(ratio * d_model))),
        "norm": draw(st.sampled_from(["layer", "rms"])),
        "prenorm": draw(st.booleans()),
        "final_norm": draw(st.booleans()),
        "positions": positions,
        "tied": kind == "decoder" and draw(st.booleans()),
        "pool": draw(st.sampled_from(["first", "mean"])),
        "classes": draw(st.integers(2, 5)),
        "moe": moe,
        "experts": experts,
        "top_k": draw(st.integers(1, 2)) if moe else 1,
        "capacity": draw(st.sampled_from([1.0, 1.5, 2.0])) if moe else 1.0,
        "dropout": draw(st.sampled_from([0.0, 0.0, 0.1])),
        "layers": layers,
        "function": draw(st.booleans()),
        "optimizer": draw(st.sampled_from(["sgd", "adam", "adamw"])),
        "clip": draw(st.sampled_from([0.0, 0.0, 1.0])),
    }
    return spec


def spec_text(spec: dict) -> str:
    """Return `spec` as one line of JSON (what `--spec` of the sweep script takes)."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


# ----------------------------------------------------------------------------- strategies


@dataclass(frozen=True)
class Parallel:
    """A strategy to train a model under: its text, how many devices, micro-batches and schedule."""

    strategy: str
    n: int
    microbatches: int = 1
    schedule: str = "gpipe"

    def __str__(self) -> str:
        extra = f" microbatches={self.microbatches} schedule={self.schedule}" if self.microbatches > 1 else ""
        return f"'{self.strategy}' on {self.n}{extra}"


def _devices(devices: list[int]) -> str:
    return ",".join(map(str, devices)) if len(devices) < 3 else f"{devices[0]}-{devices[-1]}"


def _factor(draw, size: int, moe: bool) -> dict[str, int]:
    """Draw dp, tp, pp (and with an MoE model ep) whose product is `size`."""
    degrees = {"dp": size, "tp": 1, "pp": 1, "ep": 1}
    rest = size
    for key in draw(st.permutations(["tp", "pp", "ep"] if moe else ["tp", "pp"])):
        options = [d for d in range(1, rest + 1) if rest % d == 0]
        weights = {"tp": [1, 3, 3, 2], "pp": [2, 2, 1, 1], "ep": [1, 3, 1, 2]}[key]
        pick = draw(st.sampled_from([d for d, w in zip(options, weights + [1] * 4) for _ in range(w)]))
        degrees[key] = pick
        rest //= pick
    degrees["dp"] = rest
    return degrees


def _group(draw, devices: list[int], spec: dict, alone: bool) -> str:
    """Draw one group's keys over `devices`."""
    moe = bool(spec["moe"])
    deg = _factor(draw, len(devices), moe)
    keys = [f"dp={deg['dp']}"] + [f"{k}={deg[k]}" for k in ("tp", "pp", "ep") if deg[k] > 1]
    if deg["tp"] > 1 and draw(st.integers(0, 3)) == 0:
        keys.append("sp=1")
    if deg["dp"] > 1 and draw(st.integers(0, 3)) == 0:
        stages = [1, 2, 3] if deg["pp"] == 1 and deg["ep"] == 1 else [1, 2]
        keys.append(f"zero={draw(st.sampled_from(stages))}")
    if draw(st.integers(0, 4)) == 0:
        keys.append(f"recompute={draw(st.sampled_from(['block', 'selective']))}")
    if deg["pp"] > 1 and spec["layers"] >= deg["pp"] and draw(st.integers(0, 3)) == 0:
        cuts = sorted(draw(st.sets(st.integers(1, spec["layers"] - 1), min_size=deg["pp"] - 1,
                                   max_size=deg["pp"] - 1)))
        bounds = [0, *cuts, spec["layers"]]
        keys.append("layers=" + ":".join(str(b - a) for a, b in zip(bounds, bounds[1:])))
    if not alone:
        keys.append(f"share={draw(st.integers(1, 3))}")
    return f"[{_devices(devices)}]: " + " ".join(keys)


@st.composite
def parallel_strategies(draw, spec: dict) -> Parallel:
    """Draw a strategy for the model of `spec` on 2 to 4 devices: one group (dp, tp, pp, sp, zero, ep
    in any mix) or two unlike groups with their own degrees and batch shares (and, for a mixture of
    experts, their own expert counts)."""
    n = draw(st.sampled_from([2, 2, 3, 4, 4]))
    devices = list(range(n))
    if n >= 3 and draw(st.integers(0, 2)) == 0:
        cut = draw(st.integers(1, n - 1))
        parts = [devices[:cut], devices[cut:]]
        groups = [_group(draw, p, spec, alone=False) for p in parts]
        if spec["moe"] and any("ep=" in g for g in groups) and draw(st.booleans()):
            total = spec["experts"]
            eps = [int(g.split("ep=")[1].split()[0]) if "ep=" in g else 1 for g in groups]
            first = draw(st.sampled_from([k for k in range(eps[0], total, eps[0]) if (total - k) % eps[1] == 0]
                                         or [total // 2]))
            groups = [f"{groups[0]} experts={first}", f"{groups[1]} experts={total - first}"]
        text = " | ".join(groups)
    else:
        text = _group(draw, devices, spec, alone=True)
    pipelined = "pp=" in text
    m = draw(st.sampled_from([1, 2])) if pipelined else 1
    schedule = draw(st.sampled_from(["gpipe", "1f1b"])) if pipelined else "gpipe"
    return Parallel(text, n, m, schedule)


# ----------------------------------------------------------------------------- the check


class PairFailed(AssertionError):
    """A model-strategy pair neither trained as on one device nor was refused by the strategy checks."""


@dataclass
class Outcome:
    """What a pair did: trained (its losses) or was refused (the one-line message)."""

    losses: list[float] | None = None
    refused: str | None = None


@dataclass
class Reference:
    """A model's 1-device losses (per micro-batch count and schedule: a pipeline's steps feed the
    same batch, so one reference serves every schedule)."""

    spec: dict
    losses: dict[int, list[float]] = field(default_factory=dict)
    #: the traced, differentiated step by whether its layers are stacked and how it recomputes (as
    #: `compile_script` makes it: one trace serves every strategy of the model)
    logical: dict = field(default_factory=dict)


def _script(spec: dict, microbatches: int = 1, schedule: str = "gpipe"):
    return load_script(SCRIPT, {**{f"spec.{k}": v for k, v in spec.items()}, "microbatches": microbatches,
                                "pipeline_schedule": schedule, "steps": STEPS})


def reproduce_line(spec: dict, par: Parallel | None) -> str:
    """Return the command that runs the pair again."""
    where = os.path.relpath(os.path.join(HERE, "..", "tools", "random_model_sweep.py"))
    tail = "" if par is None else (f" --strategy '{par.strategy}' -n {par.n} --microbatches {par.microbatches} "
                                   f"--schedule {par.schedule}")
    return f"python {where} --spec '{spec_text(spec)}'{tail}"


def train_in_memory(compiled, script, comm, kernels: str = "numpy") -> list[float]:
    """Return this rank's losses of `STEPS` steps of `compiled`, its plan built from the compiled
    modules (a copy of its group's) rather than from a bundle's text: the loop of
    `worker.train` without its files (printing and parsing the levels is most of a small
    model's time); the kernel level is made and its fused kernels run with `kernels="cpu"`."""
    from hspmd.dialects.levels import physical_groups
    from hspmd.runtime.kernel_exec import select_program
    from hspmd.runtime.plan import build_plan
    from hspmd.runtime.worker import split_microbatches, step_inputs

    fused = dict(compiled.kernel_groups())  # fuse-kernels runs for every pair (its failures are the compiler's)
    ((devices, group),) = [(d, g) for d, g in physical_groups(compiled.physical) if comm.rank in d]
    module = select_program(group.clone(), fused[devices].clone(), kernels)
    fn = next(o for o in module.body.block.ops if getattr(o, "sym_name", None) is not None
              and o.sym_name.data == "train_step")
    plan = build_plan(fn, comm.rank, comm)
    config = {**script.config, "lr_schedule": compiled.lr_schedule}
    state, batches = plan.initial_state(int(config.get("seed", 0))), script.batches()
    names = {leaf.name: leaf.global_shape for leaf in plan.inputs}
    losses = []
    for step in range(1, STEPS + 1):
        batch = split_microbatches({**next(batches), **step_inputs(step, config, names)}, names)
        outputs = plan.run(state, plan.local_batch(batch))
        losses.append(float(outputs["loss"]) if "loss" in outputs else float("nan"))
    return losses


def compile_pair(script, par: Parallel, ref: Reference | None = None):
    """Return `compile_script(script, par.strategy, par.n)`, the model traced once per `ref` (the
    driver's own steps: the strategy record, the trace and training passes, the lowering)."""
    from hspmd.compiler import _lower, _record, _training_step, recompute_mode, stacks_layers

    if ref is None:
        return compile_script(script, par.strategy, par.n)
    record = _record(script, par.strategy, 0, par.n, None, None)
    key = (stacks_layers([record]), recompute_mode([record]))
    if key not in ref.logical:
        ref.logical[key] = _training_step(script, True, *key)
    logical, opt = ref.logical[key]
    return _lower(script, record, logical, opt)


def train_pair(spec: dict, par: Parallel, kernels: str = "numpy", bundle: bool = False,
               ref: Reference | None = None) -> Outcome:
    """Compile `spec` under `par` and train it `STEPS` steps on the in-process communicator
    (`bundle`: through a written bundle and `worker.train`, as `hspmd run` does; else
    `train_in_memory`).

    Returns the losses (every rank's must agree), or the refusal of the strategy checks. Raises
    PairFailed for anything else: an internal error, a refusal of more than one line or naming
    nothing of the strategy, a run that fails."""
    script = _script(spec, par.microbatches, par.schedule)
    try:
        compiled = compile_pair(script, par, ref)
        compiled.kernel_groups()
    except InternalError as err:
        raise PairFailed(f"{err} (IR in {err.ir_path})") from err
    except (StrategyError, PassError) as err:
        text = str(err).strip()
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if len(lines) != 1 or not any(w in text for w in REASON_WORDS):
            raise PairFailed(f"the refusal is not one line naming what does not fit: {text!r}") from err
        return Outcome(refused=text)
    except Exception as err:  # a crash in the strategy checks (or the trace): no refusal, a bug
        raise PairFailed(f"compiling failed with {type(err).__name__}: {err}") from err
    try:
        if bundle:  # as `hspmd run` runs it: the bundle written, read back and trained by `worker.train`
            with tempfile.TemporaryDirectory(prefix="hspmd-generated-") as where:
                write_bundle(compiled, where)
                ranks = run_spmd(par.n, lambda c: train(where, c, steps=STEPS, quiet=True, kernels=kernels),
                                 timeout=300)
            losses = [r.losses for r in ranks]
        else:
            losses = run_spmd(par.n, lambda c: train_in_memory(compiled, script, c, kernels), timeout=300)
    except InternalError as err:
        raise PairFailed(f"{err} (IR in {err.ir_path})") from err
    except Exception as err:
        raise PairFailed(f"the run failed: {type(err).__name__}: {err}") from err
    for r, got in enumerate(losses):
        if not np.allclose(got, losses[0], rtol=RTOL, atol=ATOL):
            raise PairFailed(f"rank {r}'s losses {got} differ from rank 0's {losses[0]}")
    return Outcome(losses=losses[0])


def reference_losses(ref: Reference, microbatches: int, kernels: str = "numpy") -> list[float]:
    """Return (and keep) the model's 1-device losses."""
    if microbatches not in ref.losses:  # the same batches: one device, no pipeline, m does not matter
        if ref.losses:
            ref.losses[microbatches] = next(iter(ref.losses.values()))
        else:
            out = train_pair(ref.spec, Parallel("[0]: dp=1", 1), kernels, ref=ref)
            assert out.losses is not None, out.refused
            if not all(math.isfinite(v) for v in out.losses):
                raise PairFailed(f"the 1-device losses are not finite: {out.losses}")
            ref.losses[microbatches] = out.losses
    return ref.losses[microbatches]


def check_pair(ref: Reference, par: Parallel, kernels: str = "numpy", bundle: bool = False) -> Outcome:
    """Train the pair and compare it with one device; raise PairFailed (with the command that runs
    it again) unless it gives the 1-device losses within 1e-4 or is refused by the strategy checks
    (`bundle`: train it through a bundle, as `hspmd run` does)."""
    try:
        expected = reference_losses(ref, par.microbatches, kernels)
        out = train_pair(ref.spec, par, kernels, bundle, ref)
        if out.losses is not None and not np.allclose(out.losses, expected, rtol=RTOL, atol=ATOL):
            raise PairFailed(f"losses {out.losses} differ from the 1-device losses {expected}")
    except PairFailed as err:
        raise PairFailed(f"{par}: {err}\n  again: {reproduce_line(ref.spec, par)}") from err
    return out
