"""The HSPMD layout algebra: how one tensor lies across devices (DESIGN.md section 3).

Two tiers. `DistributedStates` describes one SPMD group: an ordered (major to minor) list of
mesh axes, each with a role (`split(d)`, `dup`, `partial`) and a degree. A `Layout` is a union
of `Group`s (device list + states) related by a `hetero` axis, with `shares` when the groups
hold unequal slices of one dim. Everything is immutable and hashable, and pure Python: no
xDSL is needed to use this module. `scatter` / `gather` are the brute-force NumPy model that
materialises every device's piece; the tests check the algebra against it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping, Sequence

import numpy as np

from hspmd.ir.devices import DeviceRange, DeviceSetError, RankGroups, concat

__all__ = [
    "LayoutError", "Axis", "split", "DUP", "PARTIAL", "DistributedStates", "Group", "Layout",
    "apportion", "format_devices", "scatter", "gather", "DeviceRange", "RankGroups",
]

_KINDS = ("split", "dup", "partial")


class LayoutError(ValueError):
    """A layout that is malformed, or that cannot hold a tensor of the given shape."""


@dataclass(frozen=True)
class Axis:
    """One role a mesh axis (or the hetero tier) can play: `split(dim)`, `dup` or `partial`.

    >>> str(Axis("split", 1)), str(DUP), str(PARTIAL)
    ('split(1)', 'dup', 'partial')
    """

    kind: str
    dim: int = -1

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise LayoutError(f"unknown axis kind {self.kind!r}; expected split, dup or partial")
        if self.kind == "split":
            if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
                raise LayoutError(f"split needs a tensor dim >= 0, got {self.dim!r}")
        elif self.dim != -1:
            raise LayoutError(f"{self.kind} takes no dim, got dim={self.dim!r}")

    def __str__(self) -> str:
        return f"split({self.dim})" if self.kind == "split" else self.kind


def split(dim: int) -> Axis:
    """Return the axis that splits tensor dim `dim` into equal chunks."""
    return Axis("split", operator.index(dim))


DUP = Axis("dup")
PARTIAL = Axis("partial")


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _as_shape(shape: Iterable[int]) -> tuple[int, ...]:
    out = tuple(operator.index(s) for s in shape)
    if any(s < 0 for s in out):
        raise LayoutError(f"shape {_shape_text(out)} has a negative size")
    return out


def format_devices(devices: Sequence[int]) -> str:
    """Return a device set as canonical text without brackets: a range as `a-b` (`a-b:s` strided,
    XLA's `[n]<=[...]` for a mesh), else runs of >= 3 as `a-b`.

    >>> format_devices((0, 1, 2, 3, 6, 7, 9)), format_devices(DeviceRange.span(0, 4, 8))
    ('0-3,6,7,9', '0-24:8')
    """
    if isinstance(devices, DeviceRange):
        return str(devices)
    parts: list[str] = []
    i = 0
    while i < len(devices):
        j = i
        while j + 1 < len(devices) and devices[j + 1] == devices[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{devices[i]}-{devices[j]}")
        else:
            parts.extend(str(d) for d in devices[i:j + 1])
        i = j + 1
    return ",".join(parts)


def _states_text(pairs: Iterable[tuple[object, object]]) -> str:
    text = ", ".join(f"{a}={d}" for a, d in pairs)
    return text or "dup=1"


@dataclass(frozen=True)
class DistributedStates:
    """How one SPMD group of devices holds a tensor: ordered mesh axes with degrees.

    `axes` lists (axis, degree) pairs from major to minor; a device's index in the group is a
    mixed-radix number whose digits are its coordinates on the axes. Degree-1 entries are
    dropped, so the empty states (printed `dup=1`) mean "one device holds everything".

    >>> ds = DistributedStates.of((split(0), 2), (DUP, 2))
    >>> str(ds), ds.num_devices, ds.coords(3) == {split(0): 1, DUP: 1}
    ('split(0)=2, dup=2', 4, True)
    >>> ds.slices(2, (8, 3))
    (slice(4, 8, None), slice(0, 3, None))
    """

    axes: tuple[tuple[Axis, int], ...] = ()

    def __post_init__(self) -> None:
        raw = tuple(self.axes)
        canon: list[tuple[Axis, int]] = []
        seen: set[Axis] = set()
        for entry in raw:
            try:
                axis, degree = entry
                degree = operator.index(degree)
            except (TypeError, ValueError):
                raise LayoutError(f"states entry {entry!r} is not an (Axis, degree) pair") from None
            if not isinstance(axis, Axis):
                raise LayoutError(f"states entry {entry!r} does not start with an Axis")
            if degree < 1:
                raise LayoutError(f"states '{_states_text(raw)}' give {axis} degree {degree}; degrees must be >= 1")
            if axis in seen:
                raise LayoutError(f"states '{_states_text(raw)}' name {axis} more than once")
            seen.add(axis)
            if degree > 1:
                canon.append((axis, degree))
        object.__setattr__(self, "axes", tuple(canon))

    @staticmethod
    def of(*pairs: tuple[Axis, int]) -> DistributedStates:
        """Return states from (axis, degree) pairs, major first: `of((split(0), 2), (DUP, 2))`."""
        return DistributedStates(tuple(pairs))

    @staticmethod
    def from_dict(degrees: Mapping[Axis, int]) -> DistributedStates:
        """Return states from an {axis: degree} mapping; its iteration order is major to minor."""
        return DistributedStates(tuple(degrees.items()))

    def __str__(self) -> str:
        return _states_text(self.axes)

    @property
    def num_devices(self) -> int:
        """Return the number of devices in the group: the product of the degrees."""
        return math.prod(d for _, d in self.axes)

    def degree(self, axis: Axis) -> int:
        """Return the degree of `axis` (1 when absent)."""
        for a, d in self.axes:
            if a == axis:
                return d
        return 1

    @property
    def is_partial(self) -> bool:
        """Return whether devices hold partial sums (partial degree > 1)."""
        return self.degree(PARTIAL) > 1

    @property
    def split_dims(self) -> dict[int, int]:
        """Return {tensor dim: degree} for the split axes."""
        return {a.dim: d for a, d in self.axes if a.kind == "split"}

    def _check_index(self, index: int) -> int:
        index = operator.index(index)
        if not 0 <= index < self.num_devices:
            raise LayoutError(f"index {index} is out of range for states '{self}' of {self.num_devices} devices")
        return index

    def coords(self, index: int) -> dict[Axis, int]:
        """Return the coordinate of group index `index` on each axis (first axis most significant)."""
        rest = self._check_index(index)
        out: dict[Axis, int] = {}
        for axis, deg in reversed(self.axes):
            rest, out[axis] = divmod(rest, deg)
        return {a: out[a] for a, _ in self.axes}

    def index_of(self, coords: Mapping[Axis, int]) -> int:
        """Return the group index with the given coordinates (absent axes count as 0)."""
        index = 0
        for axis, deg in self.axes:
            c = operator.index(coords.get(axis, 0))
            if not 0 <= c < deg:
                raise LayoutError(f"coordinate {c} on {axis} is out of range for states '{self}'")
            index = index * deg + c
        for axis, c in coords.items():
            if self.degree(axis) == 1 and c != 0:
                raise LayoutError(f"coordinate {c} on {axis} is out of range for states '{self}'")
        return index

    def _problem(self, shape: tuple[int, ...], where: str = "") -> str | None:
        """Return why `shape` cannot be laid out under these states, or None if it can."""
        for dim, deg in self.split_dims.items():
            if dim >= len(shape):
                return f"split({dim}) names dim {dim} but the tensor has {len(shape)} dims"
            if shape[dim] % deg:
                return f"dim {dim}{where} (size {shape[dim]}) is not divisible by {deg}"
        return None

    def local_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Return the shape of each device's piece of a tensor of `global_shape`."""
        shape = _as_shape(global_shape)
        problem = self._problem(shape)
        if problem:
            raise LayoutError(f"shape {_shape_text(shape)} cannot be laid out as '{self}': {problem}")
        sd = self.split_dims
        return tuple(s // sd.get(i, 1) for i, s in enumerate(shape))

    def slices(self, index: int, global_shape: Sequence[int]) -> tuple[slice, ...]:
        """Return the region of the tensor that group index `index` holds."""
        local = self.local_shape(global_shape)
        c = self.coords(index)
        out = [slice(0, s) for s in local]
        for axis, _ in self.axes:
            if axis.kind == "split":
                n = local[axis.dim]
                out[axis.dim] = slice(c[axis] * n, (c[axis] + 1) * n)
        return tuple(out)

    def subgroup(self, index: int, axis: Axis) -> tuple[int, ...]:
        """Return the indices sharing every coordinate with `index` but the one on `axis`, by that coordinate."""
        c = self.coords(index)
        if axis not in c:
            return (index,)
        return tuple(self.index_of({**c, axis: v}) for v in range(self.degree(axis)))

    def mesh_groups(self, axis: Axis) -> RankGroups:
        """Return the group indices that differ only on `axis`, as rank groups over range(num_devices)
        (computed, not listed: `subgroups` as a range; one group of each index when `axis` is absent).

        >>> [list(g) for g in DistributedStates.of((split(0), 2), (DUP, 2)).mesh_groups(split(0))]
        [[0, 2], [1, 3]]
        """
        degrees = [d for _, d in self.axes]
        where = next((k for k, (a, _) in enumerate(self.axes) if a == axis), None)
        if where is None:
            return RankGroups(DeviceRange.iota(self.num_devices), 1)
        return RankGroups.along(DeviceRange.iota(self.num_devices), degrees, where)

    def subgroups(self, axis: Axis) -> tuple[tuple[int, ...], ...]:
        """Return the partition of range(num_devices) into `subgroup`s along `axis`, by first element."""
        done: set[int] = set()
        out = []
        for i in range(self.num_devices):
            if i not in done:
                sg = self.subgroup(i, axis)
                done.update(sg)
                out.append(sg)
        return tuple(out)


@dataclass(frozen=True)
class Group:
    """One SPMD group: its devices (listed by group index, as a `DeviceRange`) and its states.

    Any ids may be given; they are kept as a range where they form one, so the checks (distinct,
    non-negative, as many as the degrees say) cost O(1) in the number of devices.

    >>> str(Group((0, 1, 2, 3), DistributedStates.of((split(0), 2), (DUP, 2))))
    '[0-3]: split(0)=2, dup=2'
    """

    devices: DeviceRange
    states: DistributedStates

    def __post_init__(self) -> None:
        if not isinstance(self.states, DistributedStates):
            raise LayoutError(f"group states {self.states!r} are not DistributedStates")
        if not isinstance(self.devices, DeviceRange):
            try:
                devices = DeviceRange.of(self.devices)
            except DeviceSetError:
                raise LayoutError(self._problem(self.devices)) from None
            object.__setattr__(self, "devices", devices)
        if len(self.devices) != self.states.num_devices:
            raise LayoutError(f"group '{self}' lists {len(self.devices)} devices but its degrees multiply to "
                              f"{self.states.num_devices}")

    def _problem(self, devices: object) -> str:
        """Return why `devices` are not a group's devices (for a message)."""
        try:
            ids = tuple(operator.index(d) for d in devices)  # type: ignore[attr-defined]
        except TypeError:
            return f"group devices {devices!r} are not integers"
        text = f"[{format_devices(ids)}]: {self.states}"
        if not ids:
            return f"group '{text}' has no devices"
        if any(d < 0 for d in ids):
            return f"group '{text}' has a negative device id"
        return f"group '{text}' lists a device more than once"

    def __str__(self) -> str:
        return f"{self.devices.bracketed()}: {self.states}"

    def device_index(self, device: int) -> int | None:
        """Return `device`'s index in the group (its mixed-radix coordinates' number), None if absent."""
        return self.devices.index(device) if device in self.devices else None

    def coords(self, device: int) -> dict[Axis, int]:
        """Return `device`'s coordinate on each mesh axis, computed from its id (LayoutError if absent)."""
        i = self.device_index(device)
        if i is None:
            raise LayoutError(f"device {device} is not in group '{self}'")
        return self.states.coords(i)

    def mesh_groups(self, axis: Axis) -> RankGroups:
        """Return the devices that differ only on mesh axis `axis`, as rank groups (computed, not listed).

        >>> str(Group(DeviceRange.iota(4096), DistributedStates.of((DUP, 256), (split(1), 16))).mesh_groups(DUP))
        '[16,256]<=[256,16]T(1,0)'
        """
        groups = self.states.mesh_groups(axis)
        return RankGroups(self.devices.take(groups.members), groups.size)

    def subgroup(self, device: int, axis: Axis) -> DeviceRange:
        """Return the devices that share every coordinate with `device` but the one on `axis`, by that coordinate."""
        groups = self.mesh_groups(axis)
        where = groups.group_of(device)
        if where is None:
            raise LayoutError(f"device {device} is not in group '{self}'")
        return groups[where[0]]


def apportion(total: int, shares: Sequence[int]) -> tuple[int, ...]:
    """Return `total` split into integer parts proportional to `shares` (largest remainder, ties to the first).

    >>> apportion(10, (3, 1)), apportion(5, (1, 1, 1))
    ((8, 2), (2, 2, 1))
    """
    total = operator.index(total)
    shares = tuple(operator.index(s) for s in shares)
    if total < 0 or not shares or any(s <= 0 for s in shares):
        raise LayoutError(f"cannot apportion {total} by shares {shares}: need total >= 0 and positive shares")
    whole = sum(shares)
    parts = [total * s // whole for s in shares]
    rems = [total * s % whole for s in shares]
    for i in sorted(range(len(shares)), key=lambda i: (-rems[i], i))[: total - sum(parts)]:
        parts[i] += 1
    return tuple(parts)


@dataclass(frozen=True)
class Layout:
    """The HSPMD layout of one tensor: a union of groups related by a hetero axis.

    `hetero` relates the groups: replicas (`dup`), partial sums (`partial`) or slices of one
    dim (`split(d)`, sized by `apportion(dim size, shares)`). Normalisation: with one group,
    hetero is `dup` and shares None; with hetero split, shares default to all 1s and are
    reduced by their gcd (3:1 and 6:2 are the same layout).

    >>> lay = Layout((Group((0, 1), DistributedStates.of((DUP, 2))),
    ...               Group((2,), DistributedStates())), split(0), (3, 1))
    >>> str(lay)
    '[0,1]: dup=2 | [2]: dup=1 ; hetero=split(0), shares=3:1'
    >>> lay.local_shape(2, (8, 5)), lay.slices(1, (8, 5))
    ((2, 5), (slice(0, 6, None), slice(0, 5, None)))
    """

    groups: tuple[Group, ...]
    hetero: Axis = DUP
    shares: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        object.__setattr__(self, "groups", groups)
        if not groups or not all(isinstance(g, Group) for g in groups):
            raise LayoutError(f"a layout needs one or more Groups, got {self.groups!r}")
        if not isinstance(self.hetero, Axis):
            raise LayoutError(f"hetero must be an Axis, got {self.hetero!r}")
        text = lambda: " | ".join(str(g) for g in groups)  # noqa: E731  (only for a message)
        for gi, g in enumerate(groups):  # pairwise: O(1) per pair of ranges
            for gj in range(gi):
                if not groups[gj].devices.isdisjoint(g.devices):
                    d = next(d for d in g.devices if d in groups[gj].devices)
                    raise LayoutError(f"layout '{text()}' puts device {d} in groups {gj} and {gi}")
        shares = self.shares
        if shares is not None:
            if self.hetero.kind != "split":
                raise LayoutError(f"layout '{text()}' gives shares but hetero={self.hetero}; shares need hetero=split(d)")
            shares = tuple(operator.index(s) for s in shares)
            if len(shares) != len(groups) or any(s <= 0 for s in shares):
                raise LayoutError(
                    f"layout '{text()}' has {len(groups)} groups but shares "
                    f"{':'.join(map(str, shares))}; need one positive share per group")
        if len(groups) == 1:
            object.__setattr__(self, "hetero", DUP)
            shares = None
        elif self.hetero.kind == "split":
            shares = shares or (1,) * len(groups)
            g = math.gcd(*shares)
            shares = tuple(s // g for s in shares)
        object.__setattr__(self, "shares", shares)

    @staticmethod
    def spmd(devices: Sequence[int], states: DistributedStates) -> Layout:
        """Return the one-group layout of `states` over `devices`."""
        return Layout((Group(DeviceRange.of(devices), states),))

    @staticmethod
    def replicated(devices: Sequence[int]) -> Layout:
        """Return the layout where every device in `devices` holds the whole tensor."""
        devices = DeviceRange.of(devices)
        return Layout.spmd(devices, DistributedStates(((DUP, len(devices)),)))

    def __str__(self) -> str:
        text = " | ".join(str(g) for g in self.groups)
        if len(self.groups) > 1:
            text += f" ; hetero={self.hetero}"
            if self.shares is not None:
                text += ", shares=" + ":".join(str(s) for s in self.shares)
        return text

    @cached_property
    def devices(self) -> DeviceRange:
        """Return all devices, group by group (a range where they form one)."""
        return concat([g.devices for g in self.groups])

    @property
    def num_devices(self) -> int:
        """Return the number of devices over all groups."""
        return sum(len(g.devices) for g in self.groups)

    def same_devices(self, other: Layout) -> bool:
        """Return whether `other` lies on the same set of devices (in any order or grouping)."""
        if [g.devices for g in self.groups] == [g.devices for g in other.groups]:
            return True
        return self.num_devices == other.num_devices and self.devices.same_set(other.devices)

    def _locate(self, device: int) -> tuple[int, int]:
        """Return (group, index in the group) of `device`, from its id (O(groups))."""
        for gi, g in enumerate(self.groups):
            if device in g.devices:
                return gi, g.devices.index(device)
        raise LayoutError(f"device {device} is not in layout '{self}'")

    def group_index(self, device: int) -> int:
        """Return the index of the group holding `device`."""
        return self._locate(device)[0]

    def _extent(self, g: int, shape: tuple[int, ...]) -> tuple[slice, ...]:
        out = [slice(0, s) for s in shape]
        if self.hetero.kind == "split" and self.shares is not None:
            dim = self.hetero.dim
            sizes = apportion(shape[dim], self.shares)
            start = sum(sizes[:g])
            out[dim] = slice(start, start + sizes[g])
        return tuple(out)

    def check_shape(self, global_shape: Sequence[int], what: str = "tensor") -> None:
        """Return None if a tensor of `global_shape` fits this layout; raise LayoutError saying why not."""
        shape = _as_shape(global_shape)
        problem = None
        if self.hetero.kind == "split" and self.hetero.dim >= len(shape):
            problem = f"hetero split({self.hetero.dim}) names dim {self.hetero.dim} but the tensor has {len(shape)} dims"
        for g, group in enumerate(self.groups):
            if problem:
                break
            gshape = tuple(s.stop - s.start for s in self._extent(g, shape))
            where = f" of group {g}" if self.hetero.kind == "split" and len(self.groups) > 1 else ""
            problem = group.states._problem(gshape, where)
        if problem:
            raise LayoutError(f"{what} of shape {_shape_text(shape)} cannot be laid out as '{self}': {problem}")

    def group_extent(self, g: int, global_shape: Sequence[int]) -> tuple[slice, ...]:
        """Return the region of the tensor that group `g` holds (all of it unless hetero is split)."""
        shape = _as_shape(global_shape)
        self.check_shape(shape)
        return self._extent(g, shape)

    def group_shape(self, g: int, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Return the shape of the region group `g` holds."""
        return tuple(s.stop - s.start for s in self.group_extent(g, global_shape))

    def local_shape(self, device: int, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Return the shape of `device`'s piece."""
        g, _ = self._locate(device)
        return self.groups[g].states.local_shape(self.group_shape(g, global_shape))

    def slices(self, device: int, global_shape: Sequence[int]) -> tuple[slice, ...]:
        """Return the global region that `device`'s piece covers."""
        g, i = self._locate(device)
        ext = self.group_extent(g, global_shape)
        gshape = tuple(s.stop - s.start for s in ext)
        inner = self.groups[g].states.slices(i, gshape)
        return tuple(slice(e.start + s.start, e.start + s.stop) for e, s in zip(ext, inner))

    def shift_dims(self, by: int) -> Layout:
        """Return this layout for the tensor with `by` more leading dims (fewer if negative): every
        `split(d)` becomes `split(d + by)`. A stack of per-layer tensors (`graph.scan`) is laid out
        as one layer is, shifted by 1, its stacking dim whole on every device.

        >>> str(Layout.spmd((0, 1), DistributedStates.of((split(1), 2))).shift_dims(1))
        '[0,1]: split(2)=2'

        Raises LayoutError when a dim that would go (d + by < 0) is split.
        """

        def moved(axis: Axis) -> Axis:
            if axis.kind != "split":
                return axis
            if axis.dim + by < 0:
                raise LayoutError(f"layout '{self}' splits dim {axis.dim}, which a shift by {by} drops")
            return split(axis.dim + by)

        groups = tuple(Group(g.devices, DistributedStates(tuple((moved(a), k) for a, k in g.states.axes)))
                       for g in self.groups)
        return Layout(groups, moved(self.hetero), self.shares)

    def holds_partial(self, device: int) -> bool:
        """Return whether `device`'s piece is a partial sum (partial states, or hetero partial)."""
        g, _ = self._locate(device)
        return self.groups[g].states.is_partial or self.hetero.kind == "partial"


# --------------------------------------------------------------------------------------
# Brute-force NumPy model


def _summands(value: np.ndarray, k: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    """Return `k` arrays summing to `value`: random ones when `rng` is given, else value + zeros."""
    if k == 1:
        return [value]
    if rng is None or not np.issubdtype(value.dtype, np.number):
        return [value] + [np.zeros_like(value) for _ in range(k - 1)]
    if np.issubdtype(value.dtype, np.integer):
        parts = [rng.integers(-9, 10, size=value.shape).astype(value.dtype) for _ in range(k - 1)]
    else:
        parts = [rng.standard_normal(value.shape).astype(value.dtype) for _ in range(k - 1)]
    return parts + [value - sum(parts)]


def scatter(layout: Layout, array: np.ndarray, rng: np.random.Generator | None = None) -> dict[int, np.ndarray]:
    """Return {device: piece} for `array` laid out as `layout`.

    Partial pieces are random summands drawn from `rng`, or, when `rng` is None, the value on
    the first member (coordinate 0) and zeros on the others. Dup replicas get identical pieces.
    """
    array = np.asarray(array)
    shape = array.shape
    layout.check_shape(shape)
    n = len(layout.groups)
    if layout.hetero.kind == "partial":
        values = _summands(array, n, rng)
    else:
        values = [array[layout._extent(g, shape)] for g in range(n)]
    pieces: dict[int, np.ndarray] = {}
    for group, value in zip(layout.groups, values):
        ds = group.states
        summ = _summands(value, ds.degree(PARTIAL), rng)
        for i, dev in enumerate(group.devices):
            part = summ[ds.coords(i).get(PARTIAL, 0)]
            pieces[dev] = np.array(part[ds.slices(i, value.shape)], copy=True)
    return pieces


def _agree(values: list[np.ndarray], what: str) -> np.ndarray:
    for k, v in enumerate(values[1:], 1):
        if not np.allclose(values[0], v, equal_nan=True):
            raise LayoutError(f"{what} {k} disagrees with {what} 0")
    return values[0]


def gather(layout: Layout, pieces: Mapping[int, np.ndarray], global_shape: Sequence[int]) -> np.ndarray:
    """Return the global array that `pieces` ({device: piece}) under `layout` represent.

    Partial pieces are summed; dup replicas (within a group, or across groups for hetero dup)
    must agree (np.allclose), else LayoutError.
    """
    shape = _as_shape(global_shape)
    layout.check_shape(shape)
    missing = [d for d in layout.devices if d not in pieces]
    if missing:
        raise LayoutError(f"no piece for devices {format_devices(sorted(missing))} of layout '{layout}'")
    dtype = np.result_type(*(np.asarray(pieces[d]) for d in layout.devices))
    values = []
    for g, group in enumerate(layout.groups):
        ds = group.states
        gshape = layout.group_shape(g, shape)
        expect = ds.local_shape(gshape)
        replicas: dict[int, np.ndarray] = {}
        for i, dev in enumerate(group.devices):
            piece = np.asarray(pieces[dev])
            if piece.shape != expect:
                raise LayoutError(
                    f"device {dev} holds a piece of shape {_shape_text(piece.shape)} but layout "
                    f"'{layout}' gives it {_shape_text(expect)} of {_shape_text(shape)}")
            rep = replicas.setdefault(ds.coords(i).get(DUP, 0), np.zeros(gshape, dtype))
            rep[ds.slices(i, gshape)] += piece
        values.append(_agree([replicas[k] for k in sorted(replicas)], f"in layout '{layout}', group {g} replica"))
    if layout.hetero.kind == "partial":
        return sum(values[1:], values[0])
    if layout.hetero.kind == "split":
        return np.concatenate(values, axis=layout.hetero.dim)
    return _agree(values, f"in layout '{layout}', group")
