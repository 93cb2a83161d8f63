"""Numbers of a block that differ from layer to layer, in blocks that otherwise repeat.

Some models' blocks compute with numbers made from the layer's number: Beam scales its residual
adds by `1 / sqrt(2 (i + 1))`, DiffLlama its attention by a `lambda_init` of the layer, MiniMax's
linear attention decays by rates per layer (buffers). `repeatable_lists` names the settings and
buffers behind them (`RepeatPattern.per_layer`); the export writes each block's Python numbers
into its graph as constants, so two such blocks' graphs differ in those constants only.

The importer makes them inputs of the block's function and hands each block its own values:
buffers by name; Python numbers by `record_floats`, which runs the model's loss once eagerly and
notes, for each block of the list, the floats its ATen ops take, in turn (`BlockFloats`). The
floats that differ between the blocks of a kind are the per-layer numbers; the importer finds
each in a kept block's exported graph by its value (`BlockFloats.per_layer`), and compares two
blocks of the kind with them as inputs (their graphs must then be one).

The same eager run (`_eager`) compares two blocks of a kind without exporting the second
(`eager_signatures`, for `RepeatPattern.eager_checked`): their ATen ops, arguments, and where
each tensor comes from must agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hspmd.frontend.torch_repeats import NotRepeatable


@dataclass
class BlockFloats:
    """What the blocks of a list ran, recorded eagerly: `ops[k]`, block k's ATen ops in turn (each
    with its arguments, floats masked); `floats[k]`, the floats those ops took, in turn."""

    ops: dict[int, list] = field(default_factory=dict)
    floats: dict[int, list[float]] = field(default_factory=dict)

    def varying(self, blocks: list[int]) -> list[int]:
        """Return the positions (in `floats`) where blocks of one kind take floats of their own;
        NotRepeatable where those blocks ran other ops or other arguments than floats."""
        first = blocks[0]
        for b in blocks[1:]:
            if self.ops.get(b) != self.ops.get(first):
                raise NotRepeatable(f"blocks {first} and {b} of a kind run other ops")
        return [q for q in range(len(self.floats.get(first, ())))
                if len({self.floats[b][q] for b in blocks}) > 1]

    def per_layer(self, kept: int, blocks: list[int]) -> dict[float, Callable[[int], float]]:
        """Return {a float of block `kept`: the float of block k at its place} for the floats that
        differ between `blocks` (`kept` among them, all of one kind). NotRepeatable where a value
        is ambiguous: `kept` takes it also where the blocks agree, or at two places whose floats
        differ in another block."""
        varying = self.varying(blocks)
        own = self.floats.get(kept, [])
        places: dict[float, list[int]] = {}
        for q in varying:
            places.setdefault(own[q], []).append(q)
        fixed = {own[q] for q in set(range(len(own))) - set(varying)}
        out = {}
        for value, qs in places.items():
            if value in fixed or any(len({self.floats[b][q] for q in qs}) > 1 for b in blocks):
                raise NotRepeatable(f"block {kept}'s number {value!r} is not one per-layer value")
            out[value] = lambda k, q=qs[0]: self.floats[k][q]
        return out


def record_floats(module, run: Callable[[], object], blocks) -> BlockFloats:
    """Run `run()` (`module`'s loss, once, eagerly, without gradients) and return the ATen ops and
    floats of each block of ModuleList `blocks` (`BlockFloats`; a block's nested blocks' ops are
    its own). The run leaves `module`'s buffers and PyTorch's random state as they were."""
    import torch
    from torch.utils._pytree import tree_flatten

    record = BlockFloats()

    def note(k: int, func, args, kwargs, out) -> None:
        leaves, _ = tree_flatten((args, kwargs))
        shape = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                shape.append((str(x.dtype), tuple(x.shape)))
            elif type(x) is float:
                shape.append("float")
                record.floats.setdefault(k, []).append(x)
            else:
                shape.append(repr(x))
        record.ops.setdefault(k, []).append((str(func), tuple(shape)))

    _eager(module, run, blocks, range(len(blocks)), note)
    return record


def eager_signatures(module, run: Callable[[], object], blocks, pair: tuple[int, int]) -> tuple[list, list]:
    """Run `run()` as `record_floats` does, up to the end of block `pair[1]` of ModuleList
    `blocks`, and return what the two blocks of `pair` computed, each a list that is equal for two
    blocks that compute alike on inputs alike (what their exported graphs would show): each ATen
    op with its arguments, a tensor named by where it comes from (an op of the block before it;
    a parameter or buffer of the block, by name; else an input, by its first use, with its dtype
    and shape), other arguments by value; then the tensors the block returns. An input of one
    block that is neither the other's input at its place, nor a result of a block before it (a
    value the blocks hand on), nor a tensor the loop hands the block as its own (Gemma-4's slice
    of per-layer inputs, of the other's shape and dtype), nor equal to the other's in value (a
    tensor the block holds), makes the lists differ."""
    import torch
    from torch.utils._pytree import tree_flatten

    first, second = pair
    records: dict[int, list] = {first: [], second: []}
    made: dict[int, dict[int, tuple]] = {first: {}, second: {}}  # id(tensor) -> (op, item)
    inputs: dict[int, list] = {first: [], second: []}  # the block's inputs, in first use
    keep: list = []  # every tensor noted, alive until the end (their ids stay theirs)
    handed: set[int] = set()  # ids of the results of the blocks run so far
    given: dict[int, set[int]] = {}  # ids of the tensors each block of `pair` is called with
    own = {k: {id(t): name for name, t in [*blocks[k].named_parameters(), *blocks[k].named_buffers()]}
           for k in pair}

    def name(k: int, x):
        if not isinstance(x, torch.Tensor):
            return ("f", x) if type(x) is float else repr(x)
        if id(x) in own[k]:
            return ("p", own[k][id(x)])
        if id(x) in made[k]:
            return ("n", *made[k][id(x)])
        if not any(x is y for y in inputs[k]):
            inputs[k].append(x)
            keep.append(x)
        return ("in", next(i for i, y in enumerate(inputs[k]) if y is x), str(x.dtype), tuple(x.shape))

    def note(k: int, func, args, kwargs, out) -> None:
        leaves, spec = tree_flatten((args, kwargs))
        records[k].append((str(func), str(spec), tuple(name(k, x) for x in leaves)))
        for j, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                made[k][id(t)] = (len(records[k]) - 1, j)
                keep.append(t)

    def began(k: int, args: tuple, kwargs: dict) -> None:
        if k in records:
            leaves = tree_flatten((args, kwargs))[0]
            given[k] = {id(t) for t in leaves if isinstance(t, torch.Tensor)}
            keep.extend(leaves)

    def ended(k: int, result) -> None:
        if k in records:
            records[k].append(("out", tuple(name(k, t) for t in tree_flatten(result)[0])))
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor):
                handed.add(id(t))
                keep.append(t)
        if k == second:
            raise _Enough

    _eager(module, run, blocks, pair, note, ended, began)
    a, b = records[first], records[second]
    for x, y in zip(inputs[first], inputs[second]):  # where each block's inputs come from
        alike = x is y or (id(x) in handed and id(y) in handed) or x.dtype == y.dtype and x.shape == y.shape and (
            (id(x) in given[first] and id(y) in given[second])  # tensors of their own the loop hands them
            or torch.equal(x, y))
        if not alike:
            return a, [*b, ("input unlike", str(x.dtype), tuple(x.shape))]
    return a, b


class _Enough(Exception):
    """The eager run has recorded what it was for."""


def _eager(module, run: Callable[[], object], blocks, which, note: Callable, ended: Callable | None = None,
           began: Callable | None = None) -> None:
    """Run `run()` eagerly without gradients, calling `note(k, func, args, kwargs, result)` for each
    ATen op of block k of `which` (of ModuleList `blocks`; a block's nested blocks' ops are its own),
    `began(k, args, kwargs)` before each block and `ended(k, result)` after it (it may raise
    `_Enough` to stop the run); `module`'s buffers and PyTorch's random state are as they were
    after. NotRepeatable where the model's code fails eagerly."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    inside: list[int] = []
    which = set(which)

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if inside and inside[0] in which:
                note(inside[0], func, args, kwargs, out)
            return out

    def leave(k: int, result) -> None:  # None: the result stays the block's
        inside.pop()
        if ended is not None and not inside:
            ended(k, result)

    def enter(k: int, args: tuple, kwargs: dict) -> None:  # None: the arguments stay
        if began is not None and not inside:
            began(k, args, kwargs)
        inside.append(k)

    hooks = []
    for k, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(lambda _m, a, kw, k=k: enter(k, a, kw), with_kwargs=True))
        hooks.append(block.register_forward_hook(lambda _m, _a, result, k=k: leave(k, result)))
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), Recorder():
            run()
    except _Enough:
        pass
    except NotRepeatable:
        raise
    except Exception as err:  # noqa: BLE001 - the model's code failed eagerly: export every block
        raise NotRepeatable(f"the eager run failed: {type(err).__name__}: {err}") from None
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
