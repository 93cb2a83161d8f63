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
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    record = BlockFloats()
    inside: list[int] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if inside:
                k = inside[0]
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
            return func(*args, **kwargs)

    def leave(_module, _args, _result) -> None:  # None: the result stays the block's
        inside.pop()

    hooks = []
    for k, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(lambda _m, _a, k=k: inside.append(k)))
        hooks.append(block.register_forward_hook(leave))
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), Recorder():
            run()
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
    return record
