"""Repeated layers as functions: a module traced once, then called once per use.

A module class that sets `function = True` (a transformer block, say) is traced, the first
time it is called with given parameter and input shapes, into a private `func.func @Block_0`
whose arguments are its parameters followed by its inputs. Every call, the first included,
becomes a `func.call` with the caller's parameter values, so a 48-layer model's IR is the
2-layer IR plus calls (and its parameters). A function that draws random numbers (dropout)
takes one more argument, a counter that differs per call and per step.
"""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType
from xdsl.ir import Block, Region

from hspmd.dialects import graph
from hspmd.dialects.graph.positions import step_tensor
from hspmd.frontend.tracing import Tensor, Tracer, fail
from hspmd.ir.types import element_type


def function_key(module, args: Sequence[Tensor]) -> tuple:
    """Return what decides whether two calls can share one traced function.

    Class, parameter shapes/dtypes (names differ per layer and do not matter), input
    shapes/dtypes, and the module tree's plain settings (ints, floats, strings, bools).
    """
    settings = []
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        for key, value in sorted(vars(m).items()):
            if isinstance(value, (bool, int, float, str)) and not key.startswith("_"):
                settings.append((prefix + key, value))
            elif hasattr(value, "named_parameters"):
                stack.append((f"{prefix}{key}.", value))
    params = tuple((p.shape, p.dtype) for _, p in module.named_parameters())
    inputs = tuple((a.shape, a.dtype) for a in args)
    return (type(module).__qualname__, params, inputs, tuple(sorted(settings)))


def call_module(tracer: Tracer, module, args: Sequence[Tensor], recompute: str | None = None):
    """Trace `module(*args)` as a call of its (possibly new) function; return its results.
    `recompute` ("block"): mark the function for activation recompute (`transforms/recompute.py`)."""
    for a in args:
        if not isinstance(a, Tensor) or a.tracer is not tracer:
            raise fail(type(module).__name__, "a function module takes tensors of the running trace only")
    params = [p for _, p in module.named_parameters()]
    key = function_key(module, args)
    if key not in tracer.functions:
        tracer.functions[key] = _trace_function(tracer, module, params, args, key)
    callee = tracer.functions[key]
    if recompute is not None:
        from hspmd.ir.recompute import mark

        mark(callee, recompute)
    operands = [p.traced(type(module).__name__).value for p in params] + [a.value for a in args]
    if len(callee.body.block.args) > len(operands):  # the callee draws random numbers: pass a counter
        operands.append(_call_counter(tracer, key).value)
    call = func.CallOp(callee.sym_name.data, operands, callee.function_type.outputs.data)
    tracer.emit_void(call)
    results = tuple(Tensor(r, tracer) for r in call.results)
    return results[0] if len(results) == 1 else results


def _trace_function(tracer: Tracer, module, params, args: Sequence[Tensor], key) -> func.FuncOp:
    name = f"{type(module).__name__}_{sum(1 for k in tracer.functions if k[0] == key[0])}"
    arg_types = [p.traced("call").value.type for p in params] + [a.value.type for a in args]
    block = Block(arg_types=arg_types)
    inner = Tracer(name, tracer.functions)
    inner.block = block

    def rng_counter() -> Tensor:
        """The callee's random-number counter: an extra last argument, made on first use."""
        if len(block.args) == len(arg_types):
            block.insert_arg(TensorType(element_type("int64"), ()), len(block.args))
        return Tensor(block.args[-1], inner)

    inner.rng_counter = rng_counter  # type: ignore[attr-defined]
    saved = [p._traced for p in params]
    try:
        for p, arg in zip(params, block.args):
            p._traced = Tensor(arg, inner)
        outs = module.forward(*[Tensor(arg, inner) for arg in block.args[len(params) :]])
    finally:
        for p, s in zip(params, saved):
            p._traced = s
    outs = outs if isinstance(outs, tuple) else (outs,)
    if not outs or not all(isinstance(o, Tensor) and o.tracer is inner for o in outs):
        raise fail(type(module).__name__, "a function module must return tensors it computed")
    block.add_op(func.ReturnOp(*[o.value for o in outs]))
    result_types = [o.value.type for o in outs]
    assert all(isinstance(t, TensorType) for t in result_types)
    return func.FuncOp(name, (list(block.arg_types), result_types), Region(block), visibility="private")


def _call_counter(tracer: Tracer, key) -> Tensor:
    """Return the counter for the next call of function `key`: the step, offset per call.

    Each call gets `step + (call index << 32)`, so every layer draws different random numbers
    (dropout masks) and every step too.
    """
    index = tracer.call_counts.get(key, 0)
    tracer.call_counts[key] = index + 1
    step = step_tensor(tracer)
    offset = tracer.constant(float(index << 32), (), "int64")
    return tracer.emit(graph.AddOp(step.value, offset.value))


class _Checkpointed:
    """A plain function of tensors as a module without parameters (what `checkpoint` calls)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        # part of the function key: two functions never share one traced function
        self.function_id = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}#{id(fn)}"

    def named_parameters(self):
        return iter(())

    def forward(self, *args):
        return self.fn(*args)


def checkpoint(fn, *args: Tensor):
    """Return `fn(*args)` traced as a function marked for activation recompute (`recompute=block`
    for it alone): its backward runs its forward again rather than keeping what it made.

    `fn` is an `hs.nn.Module` (its parameters are its own, as for any module) or a plain function
    of tensors, which takes every tensor it reads as an argument (parameters included, as
    `hs.nn.Parameter`s or their tensors):

        y = hs.checkpoint(lambda x, w1, w2: hs.relu(x @ w1) @ w2, x, w1, w2)
    """
    args = tuple(a.traced("checkpoint") if hasattr(type(a), "traced") else a for a in args)  # parameters
    if not args or not isinstance(args[0], Tensor):
        raise fail("checkpoint", "hs.checkpoint(fn, *args) takes the function's tensors after it")
    module = fn if hasattr(fn, "named_parameters") and hasattr(fn, "forward") else None
    if module is None:
        if not callable(fn):
            raise fail("checkpoint", f"hs.checkpoint takes a function or a module, not {type(fn).__name__}")
        name = "".join(c if c.isalnum() else "_" for c in getattr(fn, "__name__", "fn")).strip("_") or "fn"
        module = type(f"checkpoint_{name}", (_Checkpointed,), {})(fn)
    try:
        return call_module(args[0].tracer, module, args, recompute="block")
    except TypeError as err:  # fn called with the wrong arguments: the user's error, said as a trace error
        raise fail("checkpoint", str(err)) from None
