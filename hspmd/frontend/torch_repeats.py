"""Which blocks of a PyTorch model repeat, so that the importer exports only the first of them.

A transformer's `nn.ModuleList` of decoder layers is rarely all alike: Gemma-2 alternates
sliding-window and full attention, Gemma-3 puts one full layer after five sliding ones,
DeepSeek-style models start with dense layers before the expert ones, Mllama puts a
cross-attention layer at a list of places. Each is a sequence of a few kinds of block (a block's
settings, with the config's per-layer lists, transformers' `layer_types`, say: `block_key`).
`repeatable_lists` finds the lists worth cutting: those where some block is of a kind met before.

The importer (`hspmd.frontend.torch_import`) exports `RepeatPattern.blocks` only: the first
block of each kind, and the second of the first block's kind where it repeats (the config's
per-layer lists cut to match, the blocks keeping their numbers). It checks that two blocks of a
kind compute alike (a block that computes with its number shows): by their graphs, or, where
the second is not exported (`RepeatPattern.eager_checked`), by what they compute eagerly; and
calls each block left out as an exported block of its kind is called (`RepeatPattern.template`),
with the latest values the blocks before it hand on (by slot: a value's shape and dtype). The
export, the import's dearest part, so holds one block per kind and at most one more, however
deep the model. Blocks alike but for
settings or buffers of a value of their own in every block (`per_layer_values`: numbers made from
the layer's number) are of a kind too; the importer hands each its own numbers
(`hspmd.frontend.torch_layer_values`) and compares two blocks of every kind.
`repeat_pattern` names the pattern (`start` first blocks, then a `period`), for reports.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence


#: a block's settings that only number it (a block that computes with its number shows it in its
#: graph, which the importer compares between two blocks of a kind)
LAYER_INDEX = frozenset(("training", "layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "block_idx",
                         "seed"))


@dataclass(frozen=True)
class RepeatPattern:
    """A ModuleList's blocks by kind: `kinds[i]` is the first block alike to block i (i itself
    for the first of its kind). `per_layer`: the blocks' settings and buffers (dotted names within
    a block) that take a value of their own in every block (`per_layer_values`): blocks alike but
    for them, which the importer hands each block's values (`hspmd.frontend.torch_layer_values`)."""

    kinds: tuple[int, ...]
    per_layer: tuple[str, ...] = ()

    @property
    def length(self) -> int:
        """How many blocks the list holds."""
        return len(self.kinds)

    @property
    def start(self) -> int:
        """How many first blocks come before the repeats (`repeat_pattern`)."""
        return repeat_pattern(self.kinds)[0]

    @property
    def period(self) -> int:
        """After `start`, block i is alike to block i + `period` (`repeat_pattern`)."""
        return repeat_pattern(self.kinds)[1]

    @property
    def checked(self) -> tuple[int, int] | None:
        """The two blocks of one kind whose graphs the importer compares: the first block and the
        next of its kind, else the first two of the first kind that repeats (None: no kind does)."""
        again = [i for i, kind in enumerate(self.kinds) if kind != i]
        return next(((0, i) for i in again if self.kinds[i] == 0), (self.kinds[again[0]], again[0]) if again else None)

    @property
    def eager_checked(self) -> tuple[int, int] | None:
        """`checked` where the importer compares the two blocks by what they compute eagerly
        (`hspmd.frontend.torch_layer_values.eager_signatures`) rather than by their exported
        graphs, so the export leaves the second out: where the first block's kind does not
        repeat (DeepSeek-style dense first layers; the first block of a kind that repeats is
        its blocks' template then, its input a block's), without `per_layer` values."""
        checked = self.checked
        return checked if checked and checked[0] != 0 and not self.per_layer else None

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The blocks whose graphs the importer compares, two of a kind: `checked` (unless
        `eager_checked`); with `per_layer` values, the first two blocks of every kind that repeats
        (each block's values may enter its graph in another place, which a second block of the
        kind shows)."""
        if not self.per_layer:
            return (self.checked,) if self.checked and not self.eager_checked else ()
        seconds = {}
        for i, kind in enumerate(self.kinds):
            if kind != i:
                seconds.setdefault(kind, i)
        return tuple(sorted(seconds.items()))

    @property
    def blocks(self) -> tuple[int, ...]:
        """The blocks the export keeps, in order: the first of each kind and the second of each of
        `pairs` (the first block, whose input is not a block's, is no template; the second of
        `eager_checked` is compared eagerly instead)."""
        return tuple(sorted({i for i, kind in enumerate(self.kinds) if kind == i} | {b for p in self.pairs for b in p}))

    @property
    def exported(self) -> int:
        """How many blocks the export keeps."""
        return len(self.blocks)

    def template(self, k: int) -> int:
        """Return the exported block that block `k` (left out) is called as: the second of its kind
        where it is one of `pairs` (so never the first block), else the first of its kind."""
        kind = self.kinds[k]
        return next((second for first, second in self.pairs if first == kind), kind)


def repeat_pattern(items: Sequence) -> tuple[int, int]:
    """Return the (start, period) of `items` with the smallest `start + 2 * period`, then the
    smallest period: items[i] == items[i + period] for every i >= start. (0, 1) where all are
    equal; (len(items), 1) where nothing repeats."""
    n = len(items)
    for total in range(2, n + 1):
        for period in range(1, total // 2 + 1):
            start = total - 2 * period
            if all(items[i] == items[i + period] for i in range(start, n - period)):
                return start, period
    return n, 1


def pattern_of(items: Sequence) -> RepeatPattern:
    """Return the `RepeatPattern` of `items` (items alike: blocks alike)."""
    first: dict = {}
    return RepeatPattern(tuple(first.setdefault(item, i) for i, item in enumerate(items)))


def repeatable_lists(module) -> dict[str, RepeatPattern]:
    """Return {path: pattern} of the top-level `nn.ModuleList`s whose blocks repeat (see the module
    docstring) and that hold more blocks than the pattern's `exported`. What must repeat of a
    block: its class, parameters (names, shapes, dtypes), buffers and plain settings (numbers,
    strings, flags of every submodule; its number, `LAYER_INDEX`, aside), and its entry of each per-layer list of
    the model's config (a list or tuple as long as the ModuleList, not one of layer numbers).
    Settings and buffers of a value of their own in every block (`per_layer_values`) are the
    pattern's `per_layer`: their shapes and types must repeat, not their values."""
    import torch

    config = getattr(module, "config", None)
    out: dict[str, RepeatPattern] = {}
    for path, m in module.named_modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) < 3 or any(path.startswith(p + ".") for p in out):
            continue
        per_layer = [getattr(config, k) for k in per_layer_lists(config, len(m))]
        settings, buffers = per_layer_values(list(m))
        keys = [(block_key(b, settings, buffers), *(repr(v[i]) for v in per_layer)) for i, b in enumerate(m)]
        pattern = pattern_of(keys)
        names = tuple(sorted({f"{n}.{k}".lstrip(".") for n, k in settings} | buffers))
        pattern = RepeatPattern(pattern.kinds, names)
        if pattern.exported < len(m):
            out[path] = pattern
    return out


def per_layer_lists(config, length: int) -> list[str]:
    """Return the names of `config`'s per-layer lists for a ModuleList of `length` blocks: lists or
    tuples as long as it, not of layer numbers (`_counting`)."""
    return [k for k, v in (vars(config).items() if config is not None else ())
            if isinstance(v, (list, tuple)) and len(v) == length and not _counting(list(v))]


def _settings(block) -> dict[tuple[str, str], object]:
    """Return the plain settings (numbers, strings, flags) of `block` and its submodules by
    (submodule, name), its number (`LAYER_INDEX`) aside."""
    return {(name, k): v for name, sub in block.named_modules() for k, v in vars(sub).items()
            if not k.startswith("_") and k not in LAYER_INDEX and isinstance(v, (bool, int, float, str, type(None)))}


def _counting(values: list) -> bool:
    """Return whether `values` are integers `a + i * d`, d != 0: layer numbers (Llama-4's
    `moe_layers` lists every layer's), not a setting per layer."""
    if len(values) < 2 or not all(type(v) is int for v in values):
        return False
    step = values[1] - values[0]
    return step != 0 and values == [values[0] + i * step for i in range(len(values))]


def per_layer_values(blocks: Sequence) -> tuple[frozenset[tuple[str, str]], frozenset[str]]:
    """Return (settings, buffers) of `blocks` that take a value of their own in every block:
    integer settings that count with the block's number (`a + i * d`, d != 0, in block i: Beam
    numbers its residual adds so), float settings all different (DiffLlama's `lambda_init`, made
    from the layer's number), buffers all different where blocks hold them (MiniMax's decay
    rates): the block's number under another name, or values made from it."""
    settings = [_settings(b) for b in blocks]
    found = set()
    for key in settings[0]:
        values = [s.get(key) for s in settings]
        if _counting(values) or all(type(v) is float for v in values) and len(set(values)) == len(values):
            found.add(key)
    digests: dict[str, list] = {}
    for b in blocks:
        for name, buf in b.named_buffers():
            digests.setdefault(name, []).append(digest(buf))
    buffers = {n for n, d in digests.items() if len(d) > 1 and len(set(d)) == len(d)}
    return frozenset(found), frozenset(buffers)


def block_key(block, counting: frozenset[tuple[str, str]] = frozenset(), buffers: frozenset[str] = frozenset()) -> str:
    """Return what two blocks must share to compute alike (see `repeatable_lists`), the settings
    `counting` aside and the values of the `buffers` (`per_layer_values`) aside."""
    parts: list = [type(block).__qualname__]
    settings = _settings(block)
    for name, sub in block.named_modules():
        parts.append((name, type(sub).__qualname__, sorted(
            (k, repr(v)) for (n, k), v in settings.items() if n == name and (n, k) not in counting)))
    parts += [(n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters()]
    parts += [(n, tuple(b.shape), str(b.dtype)) if n in buffers else (n, digest(b)) for n, b in block.named_buffers()]
    return repr(parts)


def digest(value) -> str:
    """Return a short digest of a concrete value (a tensor's dtype, shape and bytes; a list's
    items'; another value's repr)."""
    import torch

    if isinstance(value, torch.Tensor):
        arr = value.detach().cpu()
        return hashlib.sha1(repr((str(arr.dtype), tuple(arr.shape))).encode() +
                            arr.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                            if arr.numel() else b"empty" + repr(tuple(arr.shape)).encode()).hexdigest()[:16]
    if isinstance(value, (list, tuple)):
        return repr(tuple(digest(v) for v in value))
    return repr(value)


class NotRepeatable(Exception):
    """A ModuleList's blocks do not repeat as its `RepeatPattern` says, or do not chain as the
    blocks left out of the export would need (the importer then exports every block)."""


@dataclass
class ExportedCalls:
    """What the export saw of a list's blocks: `order`, the blocks called (kept and left out) in
    turn; `outputs`, per kind, the result of its first kept block called; `slots`, for each item
    j > 0 of a block's result (a tuple), where the next block takes it (a positional index or a
    keyword: GLM-MoE-DSA hands its top-k indices on as `prev_topk_indices`); `last`, the result
    of the block called last; `made`, per kept block, (index, slot) of each item of its result
    it computes (a tensor, not one it was handed: HY-v4's "shared" layers hand their top-k indices
    on untouched), a slot being a value's shape and dtype."""

    order: list[int] = field(default_factory=list)
    outputs: dict[int, object] = field(default_factory=dict)
    slots: dict[int, int | str] = field(default_factory=dict)
    last: object = None
    made: dict[int, tuple[tuple[int, tuple], ...]] = field(default_factory=dict)
    given: dict[int, tuple] = field(default_factory=dict)  # kept block -> (its arguments' leaves, their structure)
    handed: dict[int, object] = field(default_factory=dict)  # id -> each tensor a block returned or handed on
    # (block, leaf) -> a tensor argument of a block's own (Gemma-4's slice of per-layer inputs),
    # for the left-out blocks and their templates: the export returns them (so they stay in its graph)
    own: dict[tuple[int, int], object] = field(default_factory=dict)

    def handed_on(self, k: int) -> set[tuple]:
        """Return the slots of the values kept block `k` computes that the blocks hand on (the
        first item of its result, and each item the next block takes)."""
        return {slot for j, slot in self.made.get(k, ()) if j == 0 or j in self.slots}

    def left_out(self, kept: Sequence[int]) -> dict[int, list[int]]:
        """Return {kept block: the blocks left out that were called after it, before the next kept one}."""
        out: dict[int, list[int]] = {}
        last = None
        for k in self.order:
            if k in kept:
                last = k
            elif last is None:
                raise NotRepeatable(f"block {k} is called before the first block")
            else:
                out.setdefault(last, []).append(k)
        return out

    def called(self, k: int, args: tuple, kwargs: dict) -> None:
        """Note that kept block `k` is called with `args`, `kwargs`: where it takes the items of
        the result of the block before."""
        self.order.append(k)
        self.given[k] = _leaves(args, kwargs)
        if type(self.last) is tuple:
            for j, item in enumerate(self.last[1:], 1):
                slot = next((i for i, a in enumerate(args) if a is item), None)
                slot = next((key for key, a in kwargs.items() if a is item), slot)
                if item is not None and slot is not None:
                    self.slots.setdefault(j, slot)

    def note_handed(self, result) -> None:
        """Note the tensors of a block's result (`same_origins`)."""
        import torch

        for item in (result if type(result) is tuple else (result,)):
            if isinstance(item, torch.Tensor):
                self.handed[id(item)] = item

    def same_origins(self, k: int, template: int, args: tuple, kwargs: dict) -> None:
        """Check that left-out block `k` is called as kept block `template` was in all but the
        values the blocks hand on and tensors of its own: each argument a value a block
        returned where the template's was one; else the template's own (the same tensor, an equal
        setting), or a tensor of the block's own of the template's shape and dtype where the
        template's is one too (Gemma-4 hands each layer its slice of per-layer inputs: `own`, which
        the importer hands each block); NotRepeatable otherwise."""
        import torch

        leaves, spec = _leaves(args, kwargs)
        theirs, their_spec = self.given.get(template, ((), None))
        if spec != their_spec:
            raise NotRepeatable(f"block {k} is called otherwise than block {template}")
        for at, (a, b) in enumerate(zip(leaves, theirs)):
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                if (id(a) in self.handed) != (id(b) in self.handed):
                    raise NotRepeatable(f"block {k} takes a tensor of its own where block {template} takes a "
                                        "block's result, or the other way")
                if id(a) not in self.handed and a is not b:
                    if a.shape != b.shape or a.dtype != b.dtype:
                        raise NotRepeatable(f"block {k} takes a tensor unlike block {template}'s")
                    self.own[(k, at)], self.own[(template, at)] = a, b
            elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or not _same_setting(a, b):
                raise NotRepeatable(f"block {k} is called with {a!r} where block {template} is with {b!r}")

    def hand_on(self, k: int, kind: int, args: tuple, kwargs: dict):
        """Return what left-out block `k` of `kind`, called with `args`, `kwargs`, hands on: its
        input in its kind's result's shape (a tensor, or a tuple of its input and the inputs the
        next block takes of it, Nones, and `_Unused` for an item no block takes); NotRepeatable
        where it cannot."""
        import torch

        x = args[0] if args else kwargs.get("hidden_states")
        like = self.outputs.get(kind)
        if not isinstance(x, torch.Tensor) or like is None:
            raise NotRepeatable(f"block {k} is not called on a tensor after its kind's first")
        self.order.append(k)
        if isinstance(like, torch.Tensor):
            self.last = x
            self.note_handed(x)
            return x
        if type(like) is not tuple or not like or not isinstance(like[0], torch.Tensor):
            raise NotRepeatable(f"a block returns {type(like).__name__}")
        items = [x]
        for j, item in enumerate(like[1:], 1):
            slot = self.slots.get(j)
            if item is None:
                items.append(None)
            elif isinstance(slot, int) and slot < len(args):
                items.append(args[slot])
            elif isinstance(slot, str) and slot in kwargs:
                items.append(kwargs[slot])
            else:  # no block takes it (GPT-NeoX-Japanese's attention weights): the loop must not use it
                items.append(_Unused(f"item {j} of block {k}'s result"))
        self.last = tuple(items)
        self.note_handed(self.last)
        return self.last


def _leaves(args: tuple, kwargs: dict) -> tuple[tuple, object]:
    """Return a call's arguments as (their leaves, their structure) (`torch.utils._pytree`)."""
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    return tuple(leaves), spec


def _same_setting(a, b) -> bool:
    """Return whether two arguments that are not tensors are one setting (equal, of one type)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without equality: the same object only
        return a is b


class _Unused:
    """What a stand-in hands on for an item of its result that no block takes: the export of the
    model fails (NotRepeatable, so every block is exported) where the loop computes with it."""

    def __init__(self, what: str) -> None:
        self._what = what

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise NotRepeatable(f"the model computes with {next(a._what for a in args if isinstance(a, cls))}")

    def __getattr__(self, name):
        raise NotRepeatable(f"the model reads .{name} of {self._what}")

    def __bool__(self):
        raise NotRepeatable(f"the model tests {self._what}")


def _left_out_block(block, k: int, kind: int, calls: ExportedCalls, template: int):
    """Return a module standing for block `k` (of `kind`) in the export: it hands its input on as
    its kind's kept block hands on its result (`ExportedCalls.hand_on`: it computes nothing, the
    importer calls the block there), and is the block otherwise: an instance of its class (the
    model's loop may ask `isinstance(layer, ...)`) without parameters, reading the block's settings
    (Gemma-3's `attention_type`)."""
    import torch

    def getattr_(self, name):
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            return getattr(block, name)

    def forward(self, *args, **kwargs):
        calls.same_origins(k, template, args, kwargs)
        return calls.hand_on(k, kind, args, kwargs)

    cls = type(f"LeftOut{type(block).__name__}", (type(block),), {"__getattr__": getattr_, "forward": forward})
    stand_in = cls.__new__(cls)
    torch.nn.Module.__init__(stand_in)  # not the block's own __init__: no parameters, no submodules
    return stand_in


@contextlib.contextmanager
def blocks_kept(owner, key: str, pattern: RepeatPattern) -> Iterator[ExportedCalls]:
    """Within the block, the ModuleList `owner.<key>` holds only the blocks `pattern.blocks`, the
    others stand-ins that hand their input on (`_left_out_block`), so that an export of the model
    traces those blocks only while the model's loop still sees every block at its place (its
    number, the config's per-layer lists read by it); yields the `ExportedCalls` it records."""
    import torch

    full = owner._modules[key]
    calls = ExportedCalls()
    kept = set(pattern.blocks)

    def after(k: int, args: tuple, kwargs: dict, result) -> None:  # returns None: the result stays the block's
        calls.outputs.setdefault(pattern.kinds[k], result)
        calls.last = result
        calls.note_handed(result)
        given = calls.given[k][0]  # its arguments' leaves (`ExportedCalls.called`)
        items = result if type(result) is tuple else (result,)
        calls.made[k] = tuple((j, (tuple(item.shape), str(item.dtype))) for j, item in enumerate(items)
                              if isinstance(item, torch.Tensor) and not any(item is a for a in given))

    hooks = []
    for k in kept:
        hooks.append(full[k].register_forward_pre_hook(
            lambda _m, args, kwargs, k=k: calls.called(k, args, kwargs), with_kwargs=True))
        hooks.append(full[k].register_forward_hook(
            lambda _m, args, kwargs, result, k=k: after(k, args, kwargs, result), with_kwargs=True))
    owner._modules[key] = torch.nn.ModuleList(
        full[k] if k in kept else _left_out_block(full[k], k, pattern.kinds[k], calls, pattern.template(k))
        for k in range(len(full)))
    try:
        yield calls
    finally:
        owner._modules[key] = full
        for h in hooks:
            h.remove()
