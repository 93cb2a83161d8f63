"""Import a PyTorch model: `torch.export` its loss, translate the ATen graph into the logical IR.

    program = hs.from_torch(module, example_batch, loss_fn)

`torch.export` traces `loss_fn(module, batch)` (default: `module(**batch)`, its `.loss` where
it returns a model output) on the example batch; the importer walks the exported graph and
emits the same `graph` ops an `hs.nn` model traces into, through the frontend's functions
(`hspmd/frontend/aten.py` holds one translator per ATen op). What it gives:

* **Parameters** keep their PyTorch names (`transformer.h.0.attn.c_attn.weight`) and shapes (a
  linear layer's weight stays [out, in]); a tied weight (GPT-2's `lm_head.weight` is
  `transformer.wte.weight`) is one parameter under its first name, the others recorded as its
  aliases; a parameter the loss never uses is left out. The module's own values are the initial
  values (`TorchProgram.weights`).
* **Constants**: a node whose inputs are all concrete (buffers, constants, `arange`) is
  evaluated with PyTorch at import, and enters the program where a translated op uses it (the
  rotary tables, a causal mask recognised as `graph.causal_mask`).
* **Repeated blocks stay functions**: the elements of an `nn.ModuleList` (found through
  `torch.export`'s module stack) whose graphs are alike become calls of one function per block
  type (`GPT2Block_0`), so `stack-layers` turns them into one `graph.scan` as for `hs.nn` models.
* **A tensor-parallel plan** in PyTorch's terms (`{"model.layers.*.self_attn.q_proj": "colwise",
  ...}`, `parallelize_module`'s vocabulary; default: the module's own `_tp_plan`, which
  transformers builds from `base_model_tp_plan`) is recorded on the module as the dim each
  parameter splits along over tp (`hspmd.tp_split`), which `apply-strategy` follows.

Bad input (an ATen op or an argument the importer does not translate, a buffer the loss
mutates, an export that fails) raises one `TorchImportError` naming the op, the module it came
from and the source line.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects.builtin import ModuleOp

from hspmd.dialects.dist import TP_SPLIT_ATTR, record_tp_splits
from hspmd.frontend import aten, aten_complex, aten_math, translators
from hspmd.frontend.decompose import HigherOrderOpError, decompose
from hspmd.frontend.torch_experts import experts_as_moe_ops
from hspmd.frontend.torch_layer_values import BlockFloats, eager_signatures, record_floats
from hspmd.frontend.torch_repeats import (ExportedCalls, NotRepeatable, RepeatPattern, blocks_kept, digest,
                                          repeatable_lists)
from hspmd.frontend.nn import Module, Parameter
from hspmd.frontend.tracing import Tensor, TraceError, Tracer

__all__ = ["TP_SPLIT_ATTR", "TorchImportError", "TorchProgram", "default_tp_plan", "from_torch", "tp_splits"]
#: the wrapper's attribute holding the user's module (stripped from every name)
_PREFIX = "model."


#: the dtypes a concrete tensor keeps when it enters the program (others become float32)
_LITERAL_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32")


class TorchImportError(TraceError):
    """A PyTorch model the importer cannot translate; the message names the op, the module and the line."""


@dataclass
class TorchProgram:
    """An imported model: the logical forward step and what it came with."""

    module: ModuleOp  # graph.parameter / graph.input ... graph.output "loss"
    weights: dict[str, np.ndarray]  # the module's values of the program's parameters
    aliases: dict[str, str] = field(default_factory=dict)  # a tied parameter's other name -> its name
    tp_split: dict[str, int] = field(default_factory=dict)  # parameter -> the dim tp splits
    #: a transformers model's `config.json` and what `save_pretrained` leaves out (`hugging_face`), else None
    hf: dict | None = None
    #: the ModuleLists exported in part, each with its pattern (the blocks after `exported` called
    #: as the exported ones); empty where every block was exported
    repeated: dict[str, RepeatPattern] = field(default_factory=dict)


# ----------------------------------------------------------------------------- the module tree


class _Imported(Module):
    """A module of the imported model: its parameters and children as attributes, named as in PyTorch."""


class _Block(Module):
    """An element of an `nn.ModuleList`: a function module, called with the values its graph
    takes from outside; `signature` says which blocks share one function."""

    function = True

    def forward(self, *args):
        return self._importer.replay_block(self, args)


def _tree(torch_module, prefix: str, params: dict, blocks: dict, block_classes: dict, in_list: bool) -> Module:
    """Return the hspmd module mirroring `torch_module`: a `_Block` (a subclass per PyTorch class,
    so the functions are named after it) for an element of a ModuleList, else `_Imported`."""
    import torch

    if in_list:
        name = type(torch_module).__name__
        cls = block_classes.setdefault(name, type(name, (_Block,), {}))
        node = cls()
        blocks[prefix.rstrip(".")] = node
    else:
        node = _Imported()
    for key, _ in torch_module.named_parameters(recurse=False):
        full = prefix + key
        if full in params:
            setattr(node, key, params[full])
    for key, child in torch_module.named_children():
        sub = _tree(child, f"{prefix}{key}.", params, blocks, block_classes,
                    isinstance(torch_module, torch.nn.ModuleList) and not in_list and not blocks_above(prefix, blocks))
        setattr(node, key, sub)
    return node


def blocks_above(prefix: str, blocks: dict) -> bool:
    """Return whether a block encloses the module at `prefix` (nested lists stay inside their block)."""
    return any(prefix.startswith(b + ".") for b in blocks)


# ----------------------------------------------------------------------------- the importer


def compact(arr: np.ndarray) -> np.ndarray:
    """Return `arr` with each dim along which its values repeat (bit for bit) cut to size 1: a
    mask broadcast to a batch's and heads' dims is a literal of the mask's own size, broadcast in
    the program (a chunked scan's [B, H, C, L, L] masks are not 64 MiB constants)."""
    if arr.dtype.itemsize not in (1, 2, 4, 8):
        return arr
    bits, cut = arr.view(f"u{arr.dtype.itemsize}"), False
    for d in range(arr.ndim):
        if bits.shape[d] > 1:
            first = bits[(slice(None),) * d + (slice(0, 1),)]
            if np.array_equal(bits, np.broadcast_to(first, bits.shape)):
                bits, cut = first, True
    return np.array(bits).view(arr.dtype) if cut else arr


class _Importer:
    def __init__(self, ep, params: dict[str, Parameter], canonical: dict[str, str], tracer: Tracer) -> None:
        self.ep = ep
        self.params = params  # program name -> Parameter
        self.canonical = canonical  # export target name -> program name
        self.tracer = tracer
        self.env: dict = {}  # node -> value (Tensor, concrete value, list)
        self.block_of: dict = {}  # node -> the block path it belongs to (None: the top level)
        self.blocks: dict[str, _Block] = {}
        self.runs: dict = {}  # id(block module) -> (nodes, dynamic inputs, outputs)
        self.param_nodes: dict = {}  # placeholder node -> program parameter name
        # an exported block of a list -> [(a block left out after it, the exported block it is called as)]
        self.repeats: dict[str, list[tuple[str, str]]] = {}
        self.patterns: dict[str, RepeatPattern] = {}  # list path -> its pattern (those exported in part)
        self.calls: dict[str, ExportedCalls] = {}  # list path -> what the export saw of its blocks
        self.slots_read: dict[str, set] = {}  # list path -> `read_slots`
        self.extras: list[tuple[str, int, int]] = []  # the keys of the export's last outputs (`own`)
        self.own: dict[tuple[str, int, int], object] = {}  # (list, block, argument leaf) -> its node
        self.made: dict[str, tuple] = {}  # block path -> (signature, input nodes, args, output nodes)
        self.autocast = None  # an `Autocast` where the program computes in float16/bfloat16
        self.lists: dict = {}  # list path -> its ModuleList (those of `patterns`)
        self.floats: dict[str, BlockFloats] = {}  # list path -> its blocks' floats (with per-layer values)
        # an input of a kept block standing for a per-layer value -> that value of block k (`layer_input`)
        self.layer_values: dict = {}
        self.free: dict = {}  # node -> whether it is gradient-free (`gradient_free`)

    # -- values
    def lift(self, tracer: Tracer, value, dtype: str | None) -> Tensor:
        """Return concrete `value` as a tensor of `tracer` (a splat or a literal), in `dtype` if given."""
        import torch

        if isinstance(value, (int, float, bool)):
            value = torch.tensor(value)
        if not isinstance(value, torch.Tensor):
            raise aten.Unsupported(f"a {type(value).__name__} where a tensor is needed")
        arr = value.detach().cpu()
        if arr.dtype == torch.bool:
            arr = arr.to(torch.float32 if dtype in (None, "bool") else getattr(torch, dtype))
        source = str(arr.dtype).replace("torch.", "")
        arr = (arr.float() if arr.dtype == torch.bfloat16 else arr).numpy()
        want = source if dtype in (None, "bool") else dtype
        arr = arr.astype(np.dtype(want) if want in _LITERAL_DTYPES else np.float32)
        flat = arr.reshape(-1)
        if flat.size and np.all(flat == flat[0]) and np.isfinite(flat[0]) or flat.size == 0:
            return tracer.constant(float(flat[0]) if flat.size else 0.0, arr.shape, arr.dtype.name)
        small = compact(arr)
        return tracer.literal(small).broadcast_to(arr.shape) if small.size < arr.size else tracer.literal(arr)

    def value(self, x, env: dict):
        """Return the value of an FX argument (nodes looked up in `env`, containers mapped)."""
        import torch.fx

        if isinstance(x, torch.fx.Node):
            return env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(self.value(v, env) for v in x)
        if isinstance(x, dict):
            return {k: self.value(v, env) for k, v in x.items()}
        return x

    @staticmethod
    def is_traced(x) -> bool:
        if isinstance(x, Tensor):
            return True
        if isinstance(x, (list, tuple)):
            return any(_Importer.is_traced(v) for v in x)
        if isinstance(x, dict):
            return any(_Importer.is_traced(v) for v in x.values())
        return False

    # -- nodes
    def run_node(self, node, env: dict, tracer: Tracer):
        """Compute `node`'s value in `env`: evaluated with PyTorch where its inputs are all concrete,
        else translated into ops of `tracer`'s trace."""
        name = aten.aten_name(node.target)
        for arg in node.all_input_nodes:  # PyTorch's booleans (also a function block's arguments) are masks
            if isinstance(env.get(arg), Tensor) and str(getattr(arg.meta.get("val"), "dtype", "")) == "torch.bool":
                env[arg].boolean = True
            if isinstance(env.get(arg), Tensor) and getattr(getattr(arg.meta.get("val"), "dtype", None),
                                                            "is_complex", False):
                env[arg].complex = True  # complex values are traced as (real, imaginary) pairs (`aten_complex`)
        args, kwargs = self.value(node.args, env), self.value(node.kwargs, env)
        if name in translators.ASSERTS:
            return None
        if not self.is_traced(args) and not self.is_traced(kwargs):
            return self.evaluate(node, args, kwargs)
        if name in translators.IDENTITY:
            return args[0]
        meta = node.meta.get("val")
        complex_values = aten_complex.involves(meta, args, kwargs)
        translate = (aten_complex.TRANSLATORS if complex_values else translators.TRANSLATORS).get(name)
        if translate is None:
            on = " on complex values" if complex_values else ""
            raise TorchImportError(where(node, f"the ATen op {name}{on} is not supported by the importer"))
        if self.autocast is not None and not complex_values:  # PyTorch's autocast decides the op's dtypes
            under = self.autocast.result(node.target, args, kwargs)
            meta = meta if under is None else under
            args, kwargs = self.autocast.cast_inputs(meta, args, kwargs)
        cx = aten.Context(tracer, lambda v, dtype: self.lift(tracer, v, dtype), meta)
        try:
            out = translate(cx, *args, **kwargs)
        except aten.Unsupported as err:
            raise TorchImportError(where(node, f"{name}: {err}")) from None
        except TorchImportError:
            raise
        except TraceError as err:
            raise TorchImportError(where(node, f"{name}: {err}")) from None
        if not complex_values:
            out = aten_math.coerce(out, getattr(meta, "dtype", None))  # the dtype PyTorch (under autocast) gives it
        self.check(node, out)
        boolean = str(getattr(meta, "dtype", "")) == "torch.bool"
        if isinstance(out, Tensor) and boolean != aten.is_bool(out):  # a value of its own, marked as PyTorch types it
            out = Tensor(out.value, out.tracer)
            if boolean:
                aten.as_bool(out)
        return out

    def evaluate(self, node, args, kwargs):
        """Evaluate a node of concrete inputs with PyTorch. A tensor allocated without values
        (`empty`, `new_empty`, ...: a buffer the graph writes pieces into) is zeros, so that what a
        program holds of it does not depend on the memory PyTorch happened to hand out."""
        try:
            out = node.target(*args, **kwargs)
            if _UNINITIALIZED.match(aten.aten_name(node.target)) and hasattr(out, "zero_"):
                out = out.zero_()
            return out
        except Exception as err:  # noqa: BLE001 - the model's own code: report where it failed
            raise TorchImportError(where(node, f"evaluating {aten.aten_name(node.target)} at import failed: "
                                               f"{type(err).__name__}: {err}")) from None

    @staticmethod
    def check(node, out) -> None:
        """Raise TorchImportError unless a translated tensor has the shape PyTorch gave the node."""
        shape = aten_complex.traced_shape(node.meta.get("val"))  # a complex value: its pairs' shape
        if isinstance(out, Tensor) and shape is not None and tuple(out.shape) != shape:
            raise TorchImportError(where(node, f"{aten.aten_name(node.target)}: translated to shape "
                                               f"{list(out.shape)}, PyTorch has {list(shape)}"))

    # -- blocks
    def plan_blocks(self, nodes: list) -> list:
        """Return the top-level items in order: nodes, and (block, nodes) runs of blocks whose nodes
        are contiguous (a block met twice stays inline)."""
        items: list = []
        runs: dict[str, list] = {}
        broken: set[str] = set()
        last = None
        for n in nodes:
            b = self.block_path(n)
            if b is not None and b != last and b in runs:
                broken.add(b)
            if b is not None:
                runs.setdefault(b, []).append(n)
            last = b
        seen: set[str] = set()
        for n in nodes:
            b = self.block_path(n)
            if b is None or b in broken:
                items.append(n)
            elif b not in seen:
                seen.add(b)
                items.append((b, runs[b]))
        return items

    def block_path(self, node) -> str | None:
        stack = node.meta.get("nn_module_stack") or {}
        for path, _ in stack.values():
            p = path[len(_PREFIX):] if path.startswith(_PREFIX) else None
            if p is not None and p in self.blocks:
                return p
        return None

    def gradient_free(self, node) -> bool:
        """Return whether `node` is a top-level tensor computed from integer tensors of the batch and
        constants alone (a padding mask, positions): no gradient reaches it."""
        if node not in self.free:
            self.free[node] = (node.op == "call_function" and isinstance(self.env.get(node), Tensor)
                               and self.block_path(node) is None
                               and all(a in self.env and self._free_operand(a) for a in node.all_input_nodes))
        return self.free[node]

    def _free_operand(self, node) -> bool:
        value = self.env[node]
        if not self.is_traced(value) or isinstance(value, Tensor) and value.dtype.startswith("int"):
            return True
        return self.gradient_free(node)

    def sunk(self, run: list) -> list:
        """Return the top-level nodes a block's run reads that are gradient-free, with those they
        read in turn (in graph order): the block computes them again from the integer tensors they
        come from, so no float value that needs no gradient crosses into its function (autodiff
        would give every float argument of a function a gradient, a mask's per layer)."""
        inside, found = set(run), set()

        def collect(x) -> None:
            if x in inside or x in found or not self.gradient_free(x):
                return
            found.add(x)
            for a in x.all_input_nodes:
                if self.is_traced(self.env.get(a)):
                    collect(a)

        for n in run:
            for a in n.all_input_nodes:
                collect(a)
        return [n for n in self.ep.graph.nodes if n in found]

    def signature(self, path: str, run: list, users_outside) -> tuple[list, list, str, list]:
        """Return (dynamic inputs, outputs, signature, nodes) of a block's run of nodes (the nodes:
        those the block computes again, `sunk`, then the run)."""
        import torch

        nodes = self.sunk(run) + run
        local = {n: i for i, n in enumerate(nodes)}
        inputs: list = []
        parts = []
        own = path + "."

        def ref(x):
            if isinstance(x, torch.fx.Node):
                if x in local:
                    return ("n", local[x])
                pname = self.param_nodes.get(x)
                if pname is not None and pname.startswith(own):
                    return ("p", pname[len(own):])
                v = self.env[x]
                if self.is_traced(v):
                    if x not in inputs:
                        inputs.append(x)
                    return ("in", inputs.index(x))
                return ("s", digest(v))
            if isinstance(x, (list, tuple)):
                return tuple(ref(v) for v in x)
            if isinstance(x, dict):
                return tuple(sorted((k, ref(v)) for k, v in x.items()))
            return repr(x)

        for n in nodes:
            parts.append((aten.aten_name(n.target), ref(n.args), ref(n.kwargs)))
        outputs = [n for n in run if any(u not in local for u in n.users) or n in users_outside]
        parts.append(("out", tuple(local[n] for n in outputs)))
        return inputs, outputs, hashlib.sha1(repr(parts).encode()).hexdigest()[:16], nodes

    def repeat(self, path: str) -> None:
        """Call the blocks left out after kept block `path` (`self.repeats[path]`) in turn, each
        with the arguments of the kept block it is called as, the values the blocks hand on
        (`chain`: by slot) the latest of the blocks before it; then the nodes of the chain's state
        after `path` stand for the last values of their slots. NotRepeatable where a kept block
        called as another does not take the blocks' values by slot alone (`check_repeats` checks
        the rest once every block is made)."""
        more = self.repeats[path]
        list_path = path.rpartition(".")[0]
        reads, after, _ = self.chain(list_path)
        for template in {t for _, t in more}:
            if not isinstance(reads.get(template), dict) or not reads[template]:
                raise NotRepeatable(f"{template}: {reads.get(template) or 'takes no value of the blocks before'}")
            k = int(template.rpartition(".")[2])
            returned = {self._slot(o) for o in self.made[template][3]}
            if (self.calls[list_path].handed_on(k) & self.read_slots(list_path)) - returned:
                # it computes a value the blocks take that no block after it in the export took
                raise NotRepeatable(f"{template} hands on a value its function does not return")
        state = {slot: self.env[n] for slot, n in after[path].items()}
        for left, template in more:
            args = list(self.made[template][2])
            for i, slot in reads[template].items():
                if slot not in state:
                    raise NotRepeatable(f"{left} takes a value no block before it hands on")
                args[i] = state[slot]
            block = self.blocks[left]
            block.signature = self.blocks[template].signature
            k = int(left.rpartition(".")[2])
            for i, x in enumerate(self.made[template][1]):
                if x in self.layer_values:  # block k's own number or buffer
                    args[i] = self.layer_input(self.layer_values[x](k))
            t = int(template.rpartition(".")[2])
            for (path_, block_, at), node in self.own.items():  # block k's own tensors (Gemma-4's per-layer inputs)
                if path_ == list_path and block_ == k:
                    theirs = self.own.get((list_path, t, at))
                    if theirs not in self.made[template][1]:
                        raise NotRepeatable(f"{template} does not take its own tensor as an input")
                    args[self.made[template][1].index(theirs)] = self.own_value(node)
            out = block(*args)
            for o, value in zip(self.made[template][3], out if isinstance(out, tuple) else (out,)):
                state[self._slot(o)] = value
        for slot, n in after[path].items():
            self.env[n] = state[slot]

    def _kept_called(self, list_path: str) -> list[str]:
        """Return the kept blocks of a list the export called, in turn."""
        kept = self.patterns[list_path].blocks
        return [f"{list_path}.{k}" for k in self.calls[list_path].order if k in kept]

    def check_repeats(self) -> None:
        """Raise NotRepeatable where two blocks of a list's `pairs` differ (a block that computes
        with its number, say), a kept block called after left-out ones does not take the blocks'
        values by slot (`chain`), or a node outside the list's blocks reads a value of theirs
        other than the last of its slot (the loop computes between blocks, or keeps every block's
        result: the blocks left out would not be in it)."""
        for list_path, pattern in self.patterns.items():
            for first, second in ([f"{list_path}.{k}" for k in pair] for pair in pattern.pairs):
                if any(b not in self.made for b in (first, second)) or self.made[first][0] != self.made[second][0]:
                    raise NotRepeatable(second)
            reads, after, produced = self.chain(list_path)
            called = self._kept_called(list_path)
            for before, block in zip(called, called[1:]):
                if before in self.repeats and (block not in self.made or not isinstance(reads.get(block), dict)):
                    raise NotRepeatable(f"{block}: {reads.get(block, 'not made')}")
            last = set(after[next(reversed(after))].values()) if after else set()
            inside = {n for b in after for n in self.runs[id(self.blocks[b])][0] if self.block_path(n) == b}
            tainted: set = set()
            for n in self.ep.graph.nodes:
                if n in inside:
                    continue
                read = [a for a in n.all_input_nodes if a in produced or a in tainted]
                if any(a in produced and a not in last for a in read):
                    raise NotRepeatable(f"{where(n, 'reads a value of a block of ' + list_path)} other than the "
                                        "last the blocks hand on")
                if read:
                    tainted.add(n)
            for b in after:
                if any(x in tainted for x in self.made[b][1]):
                    raise NotRepeatable(f"{b} takes a value computed from the blocks' outside them")

    def chain(self, list_path: str) -> tuple[dict, dict, set]:
        """Follow the kept blocks of a list made so far, in turn, as a chain of slots (a value's
        shape and dtype, `_slot`): what the blocks hand on (the hidden states; HY-v4's top-k indices,
        which its "shared" layers hand on untouched) is the latest value of each slot. Return
        (reads: block -> {index of an input: the slot it takes}, or why it does not take the
        latest values by slot; after: block -> {slot: node}, the chain's state after it; the nodes
        the blocks made)."""
        state: dict = {}
        reads: dict = {}
        after: dict = {}
        produced: set = set()
        for b, (_, inputs, _, outputs) in self.made.items():
            if b.rpartition(".")[0] != list_path:
                continue
            taken = {}
            for i, x in enumerate(inputs):
                if x in produced:
                    taken[i] = self._slot(x)
                    if state.get(taken[i]) is not x:
                        taken = f"{b} takes a value of a block before other than the latest of its shape"
                        break
            slots = [self._slot(o) for o in outputs]
            if len(set(slots)) < len(slots) and isinstance(taken, dict):
                taken = f"{b} hands on two values of one shape and dtype"
            reads[b] = taken
            state = {**state, **dict(zip(slots, outputs))}
            after[b] = state
            produced.update(outputs)
        return reads, after, produced

    def own_value(self, node):
        """Return the value of top-level `node` (a block's own tensor), evaluating it and what it
        reads first where the walk has not yet (it comes after the block whose left-out blocks
        take it); NotRepeatable where it reads a block's value."""
        if node in self.env:
            return self.env[node]
        order = {n: i for i, n in enumerate(self.ep.graph.nodes)}
        todo, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in self.env or n in todo:
                continue
            if n.op != "call_function" or self.block_path(n) is not None:
                raise NotRepeatable(f"a block's own tensor is made from a block's value ({n.name})")
            todo.add(n)
            stack += n.all_input_nodes
        for n in sorted(todo, key=order.__getitem__):
            self.env[n] = self.run_node(n, self.env, self.tracer)
        return self.env[node]

    def read_slots(self, list_path: str) -> set[tuple]:
        """Return the slots (`_slot`) of the values a block of a list takes from another."""
        if list_path not in self.slots_read:
            own = list_path + "."
            self.slots_read[list_path] = {
                self._slot(a) for n in self.ep.graph.nodes if (self.block_path(n) or "").startswith(own)
                for a in n.all_input_nodes
                if (self.block_path(a) or "").startswith(own) and self.block_path(a) != self.block_path(n)}
        return self.slots_read[list_path]

    def _slot(self, node) -> tuple:
        """Return the slot of a value blocks hand on: its shape and dtype (PyTorch's; a slot of its
        own where the export did not note them)."""
        val = node.meta.get("val")
        return (tuple(val.shape), str(val.dtype)) if hasattr(val, "shape") and hasattr(val, "dtype") else (node.name,)

    # -- per-layer values (`hspmd.frontend.torch_layer_values`)
    def layer_buffer(self, node, target: str) -> None:
        """Where buffer `target` is a kept block's per-layer buffer (`RepeatPattern.per_layer`),
        make `node` an input of the block's function (each block its own buffer)."""
        path = target[len(_PREFIX):]
        for list_path, pattern in self.patterns.items():
            if not path.startswith(list_path + "."):
                continue
            index, _, name = path[len(list_path) + 1:].partition(".")
            if index.isdigit() and name in pattern.per_layer:
                owner = self.lists[list_path]
                self.env[node] = self.layer_input(self.env[node])
                self.layer_values[node] = lambda k, owner=owner, name=name: owner[k].get_buffer(name)

    def layer_input(self, value) -> Tensor:
        """Return a per-layer value (a Python float: float32; a buffer) as a literal of the top
        level, one for each call, which `stack-layers` stacks with the other layers' (a constant
        or a broadcast one would not stack)."""
        import torch

        t = torch.as_tensor(value).detach().cpu()
        arr = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
        return self.tracer.literal(arr if arr.dtype.name in _LITERAL_DTYPES else arr.astype(np.float32))

    def layer_floats(self, list_path: str, floats: BlockFloats) -> None:
        """Make the per-layer floats of the kept blocks of a list inputs of their functions: in
        each kept block's nodes, a float argument of the value the block's own per-layer float
        has (`BlockFloats.per_layer`) becomes a node of its own, a top-level literal (each block
        its own); NotRepeatable where the graph holds no such float (a decomposition changed it)."""
        import torch.fx

        pattern = self.patterns[list_path]
        graph = self.ep.graph
        first = next(n for n in graph.nodes if n.op != "placeholder")
        for kept in pattern.blocks:
            members = [i for i, kind in enumerate(pattern.kinds) if kind == pattern.kinds[kept]]
            values = floats.per_layer(kept, members) if len(members) > 1 else {}
            if not values:
                continue
            path = f"{list_path}.{kept}"
            inputs: dict[float, object] = {}

            def input_for(x):
                if type(x) is not float or x not in values:
                    return x
                if x not in inputs:
                    with graph.inserting_before(first):
                        inputs[x] = graph.placeholder("layer_value")
                    self.env[inputs[x]] = self.layer_input(x)
                    self.layer_values[inputs[x]] = values[x]
                return inputs[x]

            for n in [n for n in graph.nodes if n.op == "call_function" and self.block_path(n) == path]:
                n.args = torch.fx.node.map_aggregate(n.args, input_for)
                n.kwargs = torch.fx.node.map_aggregate(n.kwargs, input_for)
            if len(inputs) < len(values):
                raise NotRepeatable(f"{path}'s per-layer numbers are not in its graph as the block takes them")

    def replay_block(self, block: _Block, args) -> tuple:
        """Trace a block's nodes with `args` standing for its dynamic inputs (the function's body)."""
        run, inputs, outputs = self.runs[id(block)]
        tracer = args[0].tracer if args else self.tracer
        env = dict(self.env)  # concrete values and parameters of the top level
        for n, a in zip(inputs, args):
            env[n] = a
        for n, pname in self.param_nodes.items():
            p = self.params.get(pname)
            if p is not None and p._traced is not None and p._traced.tracer is tracer:
                env[n] = p._traced
        for n in run:
            env[n] = self.run_node(n, env, tracer)
        outs = tuple(env[n] for n in outputs)
        if not all(isinstance(o, Tensor) and o.tracer is tracer for o in outs):
            raise _Inline(block)  # it hands on a value that is not a tensor it computed: no function
        return outs

    def import_graph(self, batch_names: list[str]) -> Tensor:
        """Translate the exported graph; return the loss."""
        import torch
        from torch.export.graph_signature import InputKind, OutputKind

        sig = self.ep.graph_signature
        for spec in sig.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                raise TorchImportError(f"the loss mutates '{spec.target}' ({spec.kind.name.lower()}): hspmd "
                                       "programs do not update buffers (BatchNorm's running statistics, say); "
                                       "put the module in eval mode or use a norm without state")
        placeholders = {n.name: n for n in self.ep.graph.nodes if n.op == "placeholder"}
        users = 0
        for spec in sig.input_specs:
            node = placeholders[spec.arg.name]
            if spec.kind == InputKind.PARAMETER:
                name = self.canonical[spec.target]
                if name not in self.params:  # the loss does not use it: left out of the program
                    continue
                self.param_nodes[node] = name
                self.env[node] = self.params[name].traced("parameter")
            elif spec.kind == InputKind.BUFFER:
                self.env[node] = self.ep.state_dict[spec.target] if spec.target in self.ep.state_dict \
                    else self.ep.constants[spec.target]
                self.layer_buffer(node, spec.target)
            elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                self.env[node] = self.ep.constants[spec.target]
            elif spec.kind == InputKind.USER_INPUT:
                self.env[node] = self.inputs[batch_names[users]]
                users += 1
        for list_path, floats in self.floats.items():
            self.layer_floats(list_path, floats)
        (output,) = [n for n in self.ep.graph.nodes if n.op == "output"]
        loss_node, *handed = output.args[0]
        if self.extras:  # the tensors of their own the blocks take (`ExportedCalls.own`), last
            handed, own = handed[:-len(self.extras)], handed[-len(self.extras):]
            self.own = dict(zip(self.extras, own))
        # the values the last blocks hand on are outputs (the blocks making them return them) where
        # a block takes them from another; the others, and what the export computed for them alone, go
        needed = [n for n in handed if any(self._slot(n) in self.read_slots(p) for p in self.patterns)]
        output.args = ((loss_node, *needed, *self.own.values()),)
        dead, erased = [n for n in handed if n not in needed], set()
        while dead:
            n = dead.pop()
            if n.op == "call_function" and not n.users and n not in erased:
                erased.add(n)
                dead += n.all_input_nodes
                self.ep.graph.erase_node(n)
        nodes = [n for n in self.ep.graph.nodes if n.op == "call_function"]
        outside = {loss_node, *needed}
        for item in self.plan_blocks(nodes):
            if isinstance(item, torch.fx.Node):
                if item not in self.env:  # (not evaluated already for a block left out: `own_value`)
                    self.env[item] = self.run_node(item, self.env, self.tracer)
                continue
            path, run = item
            block = self.blocks[path]
            inputs, outputs, sig_text, nodes = self.signature(path, run, outside)
            if not outputs or any(not self.is_traced(self.env[x]) for x in inputs) or not inputs:
                for n in run:  # nothing to call it with: inline
                    self.env[n] = self.run_node(n, self.env, self.tracer)
                continue
            block.signature = sig_text
            self.runs[id(block)] = (nodes, inputs, outputs)
            args = [self.env[x] for x in inputs]
            self.made[path] = (sig_text, inputs, args, outputs)
            try:
                results = block(*args)
            except _Inline:
                if path in self.repeats:
                    raise NotRepeatable(path) from None
                for n in run:
                    self.env[n] = self.run_node(n, self.env, self.tracer)
                continue
            results = results if isinstance(results, tuple) else (results,)
            for n, r in zip(outputs, results):
                self.env[n] = r
            if path in self.repeats:  # the blocks left out of the export: called as this one is
                self.repeat(path)
        self.check_repeats()
        loss = self.env[loss_node]
        if not isinstance(loss, Tensor) or loss.shape != ():
            raise TorchImportError(f"the loss function must return a scalar tensor, got {loss!r}")
        return loss


def where(node, message: str) -> str:
    """Return `message` prefixed with the source line and the module a node came from."""
    stack = node.meta.get("nn_module_stack") or {}
    module = ""
    if stack:
        path, cls = list(stack.values())[-1]
        path = _user_path(path)
        cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        module = f"module '{path or '(the model)'}' ({cls.rsplit('.', 1)[-1]}): "
    return f"{_source_line(node)}: {module}{message}"


def _user_path(path: str) -> str:
    """Return a module stack path without the wrapper's `model` (the user's module itself: "")."""
    return "" if path == _PREFIX[:-1] else path[len(_PREFIX):] if path.startswith(_PREFIX) else path


def _source_line(node) -> str:
    """Return `file:line` of the model code that made `node` (the innermost frame outside torch)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    for file, line in reversed(frames):
        if "/torch/" not in file:
            return f"{file}:{line}"
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else "<exported graph>"


# ----------------------------------------------------------------------------- tensor parallel plans

#: parallelize_module's styles: the dim of a weight they split, by layer kind
_LINEAR = {"colwise": 0, "colwise_rep": 0, "colwise_gather_output": 0, "local_colwise": 0,
           "rowwise": 1, "rowwise_rep": 1, "local_rowwise": 1, "vocab": 0}
_EMBEDDING = {"rowwise": 0, "embedding_rowwise": 0, "vocab": 0, "colwise": 1, "colwise_rep": 1}


def tp_splits(torch_module, plan: Mapping[str, str] | None, used: set[str]) -> dict[str, int]:
    """Return {parameter name: dim tp splits} from a plan of module-name patterns to styles
    (`colwise`, `rowwise`, `vocab`, ...): a column-parallel linear layer splits its weight
    [out, in] along dim 0 and its bias, a row-parallel one its weight along dim 1 (its bias
    stays whole); an embedding table splits its vocabulary (dim 0); transformers' `Conv1D`
    (weight [in, out]) the other way round. Styles of other layer kinds and `sequence_parallel`
    entries are left to propagation."""
    import torch

    out: dict[str, int] = {}
    for mod_name, mod in torch_module.named_modules():
        style = next((s for pat, s in (plan or {}).items() if fnmatch.fnmatchcase(mod_name, pat)), None)
        if style is None:
            continue
        weight = f"{mod_name}.weight"
        if isinstance(mod, torch.nn.Embedding) and style in _EMBEDDING:
            dims = {weight: _EMBEDDING[style]}
        elif style in _LINEAR and hasattr(mod, "weight") and getattr(mod.weight, "ndim", 0) == 2:
            dim = _LINEAR[style]
            conv1d = type(mod).__name__ == "Conv1D"  # transformers' GPT-2 layer: weight [in, out]
            dims = {weight: 1 - dim if conv1d else dim}
            if dim == 0 and getattr(mod, "bias", None) is not None:
                dims[f"{mod_name}.bias"] = 0
        else:
            continue
        out.update({k: v for k, v in dims.items() if k in used})
    return out


def default_tp_plan(torch_module) -> dict[str, str]:
    """Return the module's own tensor-parallel plan (transformers' `_tp_plan`, made from the config's
    `base_model_tp_plan` and the head's), or {}."""
    plan = getattr(torch_module, "_tp_plan", None) or getattr(torch_module, "tp_plan", None)
    if plan:
        return dict(plan)
    base = getattr(getattr(torch_module, "config", None), "base_model_tp_plan", None)
    prefix = getattr(torch_module, "base_model_prefix", "")
    if base and prefix and hasattr(torch_module, prefix):
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base or {})


# ----------------------------------------------------------------------------- entry point


def _default_loss(model, batch):
    out = model(**batch)
    return getattr(out, "loss", out) if not isinstance(out, (tuple, list)) else out[0]


def from_torch(module, example_batch: Mapping, loss_fn: Callable | None = None,
               tp_plan: Mapping[str, str] | None = None, repeat_blocks: bool = True,
               precision: str | None = None) -> TorchProgram:
    """Import `loss_fn(module, batch)` (default: `module(**batch)`'s loss) as a logical program.

    `example_batch` is a dict of arrays or tensors (the global batch the program is compiled
    for); `tp_plan` maps module-name patterns to `parallelize_module` styles (default: the
    module's own plan, `default_tp_plan`). With `repeat_blocks`, an `nn.ModuleList` whose
    blocks repeat (some alike: `repeatable_lists`)
    is exported with its first block of each kind only (and a second of one kind, `RepeatPattern.
    blocks`) and the others called as the exported block of their kind is, so the import's time, as
    the rest of the compile's, does not grow with the depth. With `precision` ("bfloat16" or "float16") the program computes as the loss does
    under `torch.autocast` in that dtype (`hspmd.frontend.autocast`), on float32 master weights.
    See the module docstring.
    """
    import torch

    batch = {k: torch.as_tensor(np.asarray(v)) for k, v in example_batch.items()}
    lists = repeatable_lists(module) if repeat_blocks else {}
    if lists:
        try:
            return _import(module, batch, loss_fn or _default_loss, tp_plan, lists, precision)
        except NotRepeatable:
            pass  # the blocks' graphs differ after all: export every one
        except TorchImportError:
            if not any(p.per_layer for p in lists.values()):
                raise
            # a block's per-layer number the importer cannot take as an input: export every block
    return _import(module, batch, loss_fn or _default_loss, tp_plan, {}, precision)


#: the ATen ops that allocate a tensor without setting its values
_UNINITIALIZED = re.compile(r"aten\.(new_)?empty(_like|_strided|_permuted)?\.")


class _Inline(Exception):
    """A block that cannot be a function (it hands on a value other than a tensor it computed)."""


def _import(module, batch: dict, loss_fn: Callable, tp_plan, lists: dict[str, RepeatPattern],
            precision: str | None = None) -> TorchProgram:
    import torch

    class _Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = module

        def forward(self, b):
            loss = loss_fn(self.model, b)
            # the values the last block hands on besides its first (HY-v4's top-k indices) are
            # outputs too, so the last kept block to make one returns it (`ExportedCalls.handed_on`);
            # so are the tensors of their own the blocks take (`ExportedCalls.own`), so they stay
            handed = [item for c in calls.values() if type(c.last) is tuple
                      for j, item in enumerate(c.last[1:], 1) if j in c.slots and isinstance(item, torch.Tensor)]
            extras[:] = [(path, k, at) for path, c in calls.items() for k, at in c.own]
            own = [calls[path].own[(k, at)] for path, k, at in extras]
            return (loss, *handed, *own) if handed or own else loss

    calls: dict[str, ExportedCalls] = {}
    extras: list[tuple[str, int, int]] = []  # (list, block, argument leaf) of each own tensor the export returns
    floats = {}
    for path, pattern in lists.items():  # the floats of blocks that take numbers of their own
        if pattern.per_layer:
            with experts_as_moe_ops(module, _groups(batch)), quiet_torch():
                floats[path] = record_floats(module, lambda: _Step()(batch), module.get_submodule(path))
        if pattern.eager_checked:  # two blocks of a kind the export leaves one of out: alike eagerly
            with experts_as_moe_ops(module, _groups(batch)), quiet_torch():
                first, second = eager_signatures(module, lambda: _Step()(batch), module.get_submodule(path),
                                                 pattern.eager_checked)
            if first != second:
                raise NotRepeatable(f"blocks {pattern.eager_checked} of {path} compute otherwise")
    try:
        with contextlib.ExitStack() as stack:
            for path, pattern in lists.items():  # export the blocks `pattern.blocks` of each repeatable list
                parent, _, key = path.rpartition(".")
                calls[path] = stack.enter_context(blocks_kept(module.get_submodule(parent) if parent else module,
                                                              key, pattern))
            with experts_as_moe_ops(module, _groups(batch)), quiet_torch():
                ep = torch.export.export(_Step(), (batch,), strict=False)
    except NotRepeatable:
        raise
    except Exception as err:  # noqa: BLE001 - the model's code failed under export: one line
        if lists:  # with stand-ins for some blocks: the export of every block tells
            raise NotRepeatable(f"{type(err).__name__}: {_first_line(err)}") from None
        raise TorchImportError(f"{failing_frame(err)}torch.export of the model's loss failed: "
                               f"{type(err).__name__}: {_first_line(err)}") from None
    try:
        with quiet_torch():
            ep = decompose(ep)
    except HigherOrderOpError as err:
        raise TorchImportError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - PyTorch's own decompositions failed on this graph
        raise TorchImportError(f"PyTorch's decompositions of the exported graph failed: {type(err).__name__}: "
                               f"{_first_line(err)}") from None
    names = {}  # id(tensor) -> first name
    canonical, aliases = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first = names.setdefault(id(p), name)
        canonical[_PREFIX + name] = first
        if first != name:
            aliases[name] = first
    used = {canonical[s.target] for s in ep.graph_signature.input_specs
            if s.kind.name == "PARAMETER" and ep.graph.find_nodes(op="placeholder", target=s.arg.name)[0].users}
    # a kept block -> [(a block left out called after it, the kept block it is called as)]
    repeats = {f"{path}.{a}": [(f"{path}.{k}", f"{path}.{p.template(k)}") for k in ks]
               for path, p in lists.items() for a, ks in calls[path].left_out(p.blocks).items()}
    for more in repeats.values():  # a block left out uses what its exported block uses
        for name, template in more:
            used |= {f"{name}.{u[len(template) + 1:]}" for u in list(used) if u.startswith(template + ".")}
    tracer = Tracer()
    values = dict(module.named_parameters())
    master = (lambda t: "float32" if precision and _dtype(t) in ("float16", "bfloat16") else _dtype(t))
    params = {name: Parameter(tuple(values[name].shape), "zeros", master(values[name])) for name in values
              if name in used}
    blocks: dict[str, _Block] = {}
    root = _tree(module, "", params, blocks, {}, False)
    for name, p in root.named_parameters():
        p._traced = tracer.parameter(name, p.shape, p.init, p.dtype)
    importer = _Importer(ep, params, canonical, tracer)
    importer.blocks, importer.repeats, importer.patterns = blocks, repeats, dict(lists)
    importer.calls = dict(calls)
    importer.extras = list(extras)
    importer.lists = {path: module.get_submodule(path) for path in lists}
    importer.floats = floats
    if precision:
        from hspmd.frontend.autocast import Autocast

        importer.autocast = Autocast(precision)
    for b in blocks.values():
        b._importer = importer
    importer.inputs = {k: tracer.input(k, tuple(v.shape), _dtype(v)) for k, v in batch.items()}
    try:
        loss = importer.import_graph(list(batch))
        if loss.dtype in ("float16", "bfloat16"):
            loss = aten.cast(loss, "float32")
        tracer.output("loss", loss)
    finally:
        for p in params.values():
            p._traced = None
    program = tracer.finish()
    plan = default_tp_plan(module) if tp_plan is None else tp_plan
    splits = tp_splits(module, plan, used)
    if splits:
        record_tp_splits(program, splits)
    weights = {n: _numpy(values[n], params[n].dtype) for n in params}
    aliases = {a: n for a, n in aliases.items() if n in used}
    return TorchProgram(program, weights, aliases, splits, hugging_face(module, set(params), aliases), dict(lists))


def hugging_face(module, params: set[str], aliases: dict[str, str]) -> dict | None:
    """Return what `hspmd checkpoint export --hf` needs of a transformers model (None for another
    module): `config`, its `config.json` (`architectures` naming its class); `tied`, the tied
    weights `save_pretrained` leaves out (transformers ties them again on loading); `absent`, the
    other entries of its state_dict the program does not hold (parameters the loss does not use,
    persistent buffers), which the export cannot write."""
    import json

    config = getattr(module, "config", None)
    if not hasattr(module, "save_pretrained") or not hasattr(config, "to_json_string"):
        return None
    described = json.loads(config.to_json_string(use_diff=False))
    described["architectures"] = [type(module).__name__]
    declared = getattr(module, "all_tied_weights_keys", None)
    tied = sorted(aliases) if declared is None else sorted(t for t, src in declared.items() if _same(module, t, src))
    absent = [k for k in module.state_dict() if k not in params and k not in aliases and k not in tied]
    return {"config": described, "tied": tied, "absent": absent}


def _same(module, a: str, b: str) -> bool:
    """Return whether parameters `a` and `b` of `module` are one tensor (tied)."""
    try:
        return module.get_parameter(a) is module.get_parameter(b)
    except AttributeError:
        return False


def _numpy(t, dtype: str) -> np.ndarray:
    """Return a copy of tensor `t`'s values as a NumPy array of `dtype` (bfloat16 through float32)."""
    import torch

    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().astype(np.dtype(dtype), copy=True)


@contextlib.contextmanager
def quiet_torch():
    """Within the block, PyTorch's loggers (the export's guards, graphs and hints) say nothing and
    its warnings are ignored: a failure is reported as one hspmd line instead."""
    names = [n for n in logging.root.manager.loggerDict if n == "torch" or n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in {"torch", *names}]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    sys.stderr.flush()
    saved = os.dup(2)  # PyTorch's handlers hold the stream they were made with: silence the file itself
    try:
        with tempfile.TemporaryFile() as sink, warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            os.dup2(sink.fileno(), 2)
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def failing_frame(err: BaseException) -> str:
    """Return "file:line: " of the innermost frame of `err`'s traceback in the model's own code
    (outside PyTorch and hspmd), or ""."""
    import traceback

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = os.path.abspath(frame.filename)
        if f"{os.sep}torch{os.sep}" not in path and not path.startswith(here + os.sep) and "<" not in frame.filename:
            return f"{frame.filename}:{frame.lineno}: "
    return ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _groups(batch: dict) -> int:
    """Return the routing groups of an expert layer: the batch's sequences (its leading dim)."""
    sizes = {int(v.shape[0]) for v in batch.values() if getattr(v, "ndim", 0) >= 1}
    return sizes.pop() if len(sizes) == 1 else 1


def _dtype(t) -> str:
    name = str(t.dtype).replace("torch.", "")
    if name not in ("float32", "float64", "float16", "bfloat16", "int64", "int32"):
        raise TorchImportError(f"a tensor of dtype {name} (hspmd takes float16/32/64, bfloat16, int32, int64)")
    return name
