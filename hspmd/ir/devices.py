"""Device sets as ranges: ordered sets of distinct device ids, stored as iota expressions.

A `DeviceRange` is the sequence `start + sum(c[k] * strides[k])` over the coordinates `c` of
`shape`, in row-major order: XLA's iota tile assignment (`[256,16]<=[4096]`, HloSharding V2)
with a start and positive strides, so that a sub-mesh, a strided sub-group and a transposed
mesh are all one. Explicit id lists remain only where a set is irregular (a lost rank, a
user's `[5,0,1]`). Length, membership, a member's index and the member at an index are O(1)
in the number of devices (O(number of mesh dims)); so are the checks a group needs (distinct,
non-negative, count): a range's strides are *nested* (each, in increasing order, exceeds the
span of all smaller ones), which makes its ids distinct by construction.

    >>> r = DeviceRange.of([0, 16, 32, 48])
    >>> str(r), len(r), r[2], 32 in r, r.index(48)
    ('0-48:16', 4, 32, True, 3)
    >>> str(DeviceRange.iota(4096).take(DeviceRange.box(0, (16, 256), (1, 16))))
    '[4096]<=[256,16]T(1,0)'

`RankGroups` are the disjoint, equal-sized rank groups of a collective: a `DeviceRange` of
members cut into consecutive groups of `size` (XLA's IotaReplicaGroupList):

    >>> g = RankGroups.along(DeviceRange.iota(8), (2, 4), 0)   # mesh 2x4, groups along axis 0
    >>> str(g), [list(x) for x in g], g.group_of(6)
    ('[4,2]<=[2,4]T(1,0)', [[0, 4], [1, 5], [2, 6], [3, 7]], (2, 1))

Text (`parse_devices`, `parse_rank_groups`): a device set is a comma list of ids, runs `a-b`
and strided runs `a-b:s` (`0-4095`, `3-65531:8`), or an iota expression `[n]<=[r0,r1]T(p)`
with an optional `*step` and `+start`; rank groups are the iota form `[G,S]<=[...]` or, when
irregular, `{0,1},{2,3}`. Printing is canonical: equal sets print alike and read back equal.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DeviceRange", "DeviceSetError", "RankGroups", "RankPairs", "concat", "iota_members", "parse_devices",
           "parse_rank_groups", "parse_rank_pairs"]



class DeviceSetError(ValueError):
    """A malformed device set: repeated or negative ids, or text that names no set."""


def _nested(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Return whether the strides, in increasing order, each exceed the span of all smaller ones."""
    span = 0
    for s, n in sorted(zip(strides, shape)):
        if s <= span:
            return False
        span += s * (n - 1)
    return True


def _normalized(shape: Sequence[int], strides: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (shape, strides) with size-1 dims dropped and mergeable neighbours merged."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    out: list[list[int]] = []
    for n, s in reversed(dims):  # minor first
        if out and out[-1][1] * out[-1][0] == s:
            out[-1][0] *= n
        else:
            out.append([n, s])
    out.reverse()
    return tuple(n for n, _ in out), tuple(s for _, s in out)


def _detect(ids: Sequence[int]) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """Return (start, shape, strides) of the box whose row-major sequence is `ids`, or None (O(len))."""
    n = len(ids)
    if n == 0:
        return None
    if n == 1:
        return ids[0], (), ()
    d = ids[1] - ids[0]
    if d <= 0:
        return None
    m = 2
    while m < n and ids[m] - ids[m - 1] == d:
        m += 1
    if n % m:
        return None
    if m == n:
        return ids[0], (n,), (d,)
    for r in range(m, n, m):
        base = ids[r]
        if any(ids[r + j] != base + j * d for j in range(1, m)):
            return None
    outer = _detect(ids[::m])
    if outer is None:
        return None
    start, shape, strides = outer
    return start, shape + (m,), strides + (d,)


@dataclass(frozen=True, eq=False)
class DeviceRange(Sequence[int]):
    """An ordered set of distinct device ids (see the module docstring).

    Build one with `of` (any ids: a range is found when they form one), `iota`, `span` or `box`.
    Either `ids` is None and the set is the box (`start`, `shape`, `strides`), or `ids` lists an
    irregular set (then `start` is its first id and `shape`/`strides` are empty).
    Equal to another DeviceRange, or to a tuple or list, with the same ids in the same order,
    and hashed as that tuple is (so either finds the other in a dict).
    """

    start: int
    shape: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    ids: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ construction

    @staticmethod
    def of(devices: Iterable[int]) -> DeviceRange:
        """Return the range of `devices` (a DeviceRange, a Python range, or any ids: O(len) to find the range)."""
        if isinstance(devices, DeviceRange):
            return devices
        if isinstance(devices, range):
            if len(devices) and devices.step > 0:
                return DeviceRange.span(devices.start, len(devices), devices.step)
        try:
            ids = tuple(operator.index(d) for d in devices)
        except TypeError:
            raise DeviceSetError(f"device ids {devices!r} are not integers") from None
        if not ids:
            raise DeviceSetError("a device set needs at least one device")
        if any(d < 0 for d in ids):
            raise DeviceSetError(f"device set {_list_text(ids)} has a negative id")
        found = _detect(ids)
        if found is not None and _nested(found[1], found[2]):
            start, shape, strides = found
            return DeviceRange(start, *_normalized(shape, strides))
        if len(set(ids)) != len(ids):
            raise DeviceSetError(f"device set {_list_text(ids)} names a device more than once")
        return DeviceRange(ids[0], (), (), ids)

    @staticmethod
    def iota(n: int, start: int = 0) -> DeviceRange:
        """Return `start, start+1, ..., start+n-1`."""
        return DeviceRange.span(start, n)

    @staticmethod
    def span(start: int, n: int, step: int = 1) -> DeviceRange:
        """Return `n` ids from `start` by `step` (> 0)."""
        return DeviceRange.box(start, (n,), (step,))

    @staticmethod
    def box(start: int, shape: Sequence[int], strides: Sequence[int]) -> DeviceRange:
        """Return the ids `start + sum(c[k] * strides[k])` over `shape`'s coordinates, row-major.

        Strides must be positive and nested (see the module docstring) so that the ids are
        distinct; other boxes are refused (DeviceSetError).
        """
        start = operator.index(start)
        shape = tuple(operator.index(n) for n in shape)
        strides = tuple(operator.index(s) for s in strides)
        if len(shape) != len(strides) or any(n < 1 for n in shape):
            raise DeviceSetError(f"a device box needs one stride per dim and dims >= 1, got {shape} by {strides}")
        if start < 0:
            raise DeviceSetError(f"device box from {start} has a negative id")
        shape, strides = _normalized(shape, strides)
        if any(s < 1 for s in strides) or not _nested(shape, strides):
            raise DeviceSetError(f"device box {list(shape)} by strides {list(strides)} from {start} "
                                 "repeats an id or steps backwards")
        return DeviceRange(start, shape, strides)

    # ------------------------------------------------------------------ the sequence

    @property
    def is_range(self) -> bool:
        """Return whether the set is stored as an iota expression (not a list)."""
        return self.ids is None

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else math.prod(self.shape)

    def _coords(self, i: int) -> Iterator[int]:
        for n in reversed(self.shape):
            i, c = divmod(i, n)
            yield c

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self._slice(i)
        i = operator.index(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"device index {i} out of range for {len(self)} devices")
        if self.ids is not None:
            return self.ids[i]
        return self.start + sum(c * s for c, s in zip(self._coords(i), reversed(self.strides)))

    def _slice(self, sl: slice) -> DeviceRange | tuple[int, ...]:
        start, stop, step = sl.indices(len(self))
        count = len(range(start, stop, step))
        if count == 0:
            return ()
        if step < 0:
            return tuple(self[i] for i in range(start, stop, step))
        return self.take(DeviceRange.span(start, count, step))

    def array(self) -> np.ndarray:
        """Return the ids as an int64 array (O(len); for what really needs every id)."""
        if self.ids is not None:
            return np.asarray(self.ids, dtype=np.int64)
        out = np.full((1,) * len(self.shape), self.start, dtype=np.int64)
        for k, (n, s) in enumerate(zip(self.shape, self.strides)):
            out = out + (np.arange(n, dtype=np.int64) * s).reshape((1,) * k + (n,) + (1,) * (len(self.shape) - k - 1))
        return out.reshape(-1)

    def __iter__(self) -> Iterator[int]:
        if self.ids is not None:
            return iter(self.ids)
        if len(self.shape) == 1:
            return iter(range(self.start, self.start + self.shape[0] * self.strides[0], self.strides[0]))
        return iter(self.array().tolist())

    def _decode(self, device: int) -> tuple[int, ...] | None:
        """Return the coordinates of `device` in the box (None if absent); O(dims) by nestedness."""
        r = device - self.start
        if r < 0:
            return None
        coords = [0] * len(self.shape)
        for k in sorted(range(len(self.shape)), key=lambda k: -self.strides[k]):
            c, r = divmod(r, self.strides[k])
            if c >= self.shape[k]:
                return None
            coords[k] = c
        return tuple(coords) if r == 0 else None

    def __contains__(self, device: object) -> bool:
        try:
            d = operator.index(device)  # type: ignore[arg-type]
        except TypeError:
            return False
        if self.ids is not None:
            return d in self.ids
        return self._decode(d) is not None

    def index(self, device: int, start: int = 0, stop: int | None = None) -> int:  # type: ignore[override]
        """Return the position of `device` (ValueError if absent)."""
        if self.ids is not None:
            return self.ids.index(device, start, len(self.ids) if stop is None else stop)
        coords = self._decode(operator.index(device))
        if coords is None:
            raise ValueError(f"device {device} is not in {self}")
        i = 0
        for c, n in zip(coords, self.shape):
            i = i * n + c
        if i < start or (stop is not None and i >= stop):
            raise ValueError(f"device {device} is not in {self}[{start}:{stop}]")
        return i

    def count(self, device: int) -> int:  # type: ignore[override]
        return 1 if device in self else 0

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DeviceRange):
            return (self.start, self.shape, self.strides, self.ids) == (other.start, other.shape, other.strides, other.ids)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other: object) -> tuple[int, ...]:
        """Return the ids and `other`'s as a tuple (as a tuple of ids would; O(len))."""
        if isinstance(other, (tuple, list, DeviceRange)):
            return (*self, *other)
        return NotImplemented

    def __radd__(self, other: object) -> tuple[int, ...]:
        if isinstance(other, (tuple, list)):
            return (*other, *self)
        return NotImplemented

    def __hash__(self) -> int:
        # the hash of the tuple of ids, as equality with tuples asks (computed once: O(len))
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash(self.ids if self.ids is not None else tuple(self))
            self.__dict__["_hash"] = h
            return h

    def __repr__(self) -> str:
        return f"DeviceRange.of({str(self)!r})" if self.ids is None else f"DeviceRange.of({list(self.ids)!r})"

    # ------------------------------------------------------------------ sets

    @property
    def min(self) -> int:
        """Return the smallest id."""
        return min(self.ids) if self.ids is not None else self.start

    @property
    def max(self) -> int:
        """Return the largest id."""
        if self.ids is not None:
            return max(self.ids)
        return self.start + sum((n - 1) * s for n, s in zip(self.shape, self.strides))

    def sorted(self) -> DeviceRange:
        """Return the same set in increasing order."""
        if self.ids is not None:
            return DeviceRange.of(sorted(self.ids))
        order = sorted(range(len(self.shape)), key=lambda k: -self.strides[k])
        return DeviceRange.box(self.start, [self.shape[k] for k in order], [self.strides[k] for k in order])

    def same_set(self, other: DeviceRange) -> bool:
        """Return whether the two hold the same ids, in any order."""
        return len(self) == len(other) and self.sorted() == other.sorted()

    def issubset(self, other: DeviceRange) -> bool:
        """Return whether every id is in `other` (O(1) when `other` is a run or a strided run, else
        O(len))."""
        if len(self) > len(other) or self.min < other.min or self.max > other.max:
            return False
        o = other.sorted()
        if o.ids is None and len(o.shape) <= 1:
            step = o.strides[0] if o.shape else 1
            mine = self.sorted()
            return (mine.start - o.start) % step == 0 and (mine.ids is None and all(s % step == 0 for s in mine.strides)
                                                           or all((d - o.start) % step == 0 for d in mine))
        return all(d in other for d in self)

    def isdisjoint(self, other: DeviceRange) -> bool:
        """Return whether no id is in both (O(1) for two strided runs or apart bounds; else
        O(size of the smaller))."""
        if self.max < other.min or other.max < self.min:
            return True
        a, b = self.sorted(), other.sorted()
        if a.ids is None and b.ids is None and len(a.shape) == 1 and len(b.shape) == 1:
            return not _progressions_meet(a.start, a.strides[0], len(a), b.start, b.strides[0], len(b))
        small, big = (a, b) if len(a) <= len(b) else (b, a)
        return not any(d in big for d in small)

    # ------------------------------------------------------------------ composition

    def positions(self, sub: DeviceRange) -> DeviceRange:
        """Return the position in this set of each id of `sub` (`[self.index(d) for d in sub]`),
        computed where this set is a run or a strided run and `sub` a range on it, else listed."""
        if self.ids is None and len(self.shape) <= 1 and sub.ids is None:
            step = self.strides[0] if self.shape else 1
            if (sub.start - self.start) % step == 0 and all(t % step == 0 for t in sub.strides) \
                    and sub.issubset(self):
                return DeviceRange.box((sub.start - self.start) // step, sub.shape, [t // step for t in sub.strides])
        return DeviceRange.of([self.index(d) for d in sub])

    def take(self, indices: DeviceRange) -> DeviceRange:
        """Return `[self[i] for i in indices]`, as a range where the two compose (no carries), else a list."""
        if not isinstance(indices, DeviceRange):
            indices = DeviceRange.of(indices)
        if self.ids is None and indices.ids is None:
            composed = _compose(self, indices)
            if composed is not None:
                return composed
        return DeviceRange.of([self[i] for i in indices])

    # ------------------------------------------------------------------ text

    def __str__(self) -> str:
        """Return the canonical text, the shorter of the range's (`0-4095`, `3-65531:8`, XLA's
        `[8]<=[2,4]T(1,0)`, `*step`, `+start`) and the list's (`0,2,5`; ties go to the list)."""
        if self.ids is not None:
            return _list_text(self.ids)
        n = len(self)
        text = self._range_text()
        if n <= 16 or text is None:
            listed = _list_text(tuple(self))
            if text is None or len(listed) <= len(text):
                return listed
        return text

    def bracketed(self) -> str:
        """Return the text as a group writes it: `[0-3]`, `[0,2,5]`, or a bare iota `[8]<=[2,4]`."""
        text = str(self)
        return text if text.startswith("[") else f"[{text}]"

    def _range_text(self) -> str | None:
        if not self.shape:
            return None
        if len(self.shape) == 1:
            last = self.start + (len(self) - 1) * self.strides[0]
            return f"{self.start}-{last}" + (f":{self.strides[0]}" if self.strides[0] != 1 else "")
        text = _iota_text((len(self),), self.start, self.shape, self.strides)
        if text is None and len(self.shape) == 2 and self.shape[0] <= 4:  # a few rows of a strided run each
            text = ",".join(str(DeviceRange.span(self.start + c * self.strides[0], self.shape[1], self.strides[1]))
                            for c in range(self.shape[0]))
        return text or _box_text((len(self),), self.start, self.shape, self.strides)


def _list_text(ids: Sequence[int]) -> str:
    """Return ids as text with runs of >= 3 consecutive ids as `a-b` (the list form)."""
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ids[i]}-{ids[j]}")
        else:
            parts.extend(str(d) for d in ids[i:j + 1])
        i = j + 1
    return ",".join(parts)


def _progressions_meet(a: int, s: int, n: int, b: int, t: int, m: int) -> bool:
    """Return whether a + s*i (0 <= i < n) and b + t*j (0 <= j < m) share a value."""
    g = math.gcd(s, t)
    if (b - a) % g:
        return False
    lcm = s // g * t
    # the smallest x >= max(a, b) with x = a (mod s) and x = b (mod t), by the extended Euclid
    s_g, t_g = s // g, t // g
    inv = pow(s_g, -1, t_g) if t_g > 1 else 0
    x = a + s * (((b - a) // g * inv) % t_g if t_g > 1 else 0)
    lo = max(a, b)
    if x < lo:
        x += -(-(lo - x) // lcm) * lcm
    return x <= min(a + s * (n - 1), b + t * (m - 1))


def _place_values(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _compose(devs: DeviceRange, idx: DeviceRange) -> DeviceRange | None:
    """Return devs[idx] as a box when every dim of `idx` stays inside digits of `devs` without
    carries (the case of sub-meshes, sub-groups and transposes), else None."""
    if not devs.shape:
        return devs if len(idx) == 1 and idx.start == 0 else None
    shape, strides = devs.shape, devs.strides
    place = _place_values(shape)
    if idx.start >= len(devs) or idx.max >= len(devs):
        return None
    base_digits = list(devs._coords(idx.start))[::-1]
    used = list(base_digits)  # the largest value each digit reaches
    out_shape: list[int] = []
    out_strides: list[int] = []
    for m, t in zip(idx.shape, idx.strides):
        pieces: list[tuple[int, int]] = []  # (size, device stride), major first
        while m > 1:
            k = next((k for k in range(len(shape)) if t % place[k] == 0 and t // place[k] < shape[k]), None)
            if k is None:
                return None
            q = t // place[k]
            if used[k] + q * (m - 1) < shape[k]:
                pieces.insert(0, (m, q * strides[k]))
                used[k] += q * (m - 1)
                m = 1
            else:
                inner = shape[k] // q
                if shape[k] % q or m % inner or used[k] + q * (inner - 1) >= shape[k]:
                    return None
                pieces.insert(0, (inner, q * strides[k]))
                used[k] += q * (inner - 1)
                m //= inner
                t *= inner
        # the pieces of one index dim are major to minor in the reverse order found: the last found is major
        for size, stride in pieces:
            out_shape.append(size)
            out_strides.append(stride)
    start = devs.start + sum(c * s for c, s in zip(base_digits, strides))
    shape2, strides2 = _normalized(out_shape, out_strides)
    if any(s < 1 for s in strides2) or not _nested(shape2, strides2):
        return None
    return DeviceRange(start, shape2, strides2)


def _box_text(dims: tuple[int, ...], start: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    """Return `[dims]<=[shape]@[strides]+start`: the box's ids read row-major, cut into `dims`."""
    return ("[" + ",".join(map(str, dims)) + "]<=[" + ",".join(map(str, shape)) + "]@["
            + ",".join(map(str, strides)) + "]" + (f"+{start}" if start else ""))


def _iota_text(dims: tuple[int, ...], start: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> str | None:
    """Return XLA's `[dims]<=[r...]T(p...)` (and `*step`, `+start`) for a dense scaled box, else None."""
    order = sorted(range(len(shape)), key=lambda k: strides[k])  # minor first
    step = strides[order[0]]
    acc = step
    for k in order:
        if strides[k] != acc:
            return None
        acc *= shape[k]
    major = order[::-1]  # the reshape dims, major first
    perm = [major.index(k) for k in range(len(shape))]
    text = "[" + ",".join(map(str, dims)) + "]<=[" + ",".join(str(shape[k]) for k in major) + "]"
    if perm != sorted(perm):
        text += "T(" + ",".join(map(str, perm)) + ")"
    if step != 1:
        text += f"*{step}"
    if start:
        text += f"+{start}"
    return text


# ---------------------------------------------------------------------------- rank groups


@dataclass(frozen=True, eq=False)
class RankGroups(Sequence[DeviceRange]):
    """Disjoint rank groups of one size: `members` cut into consecutive groups of `size`.

    Group g is `members[g*size:(g+1)*size]`; a rank's position in its group is its chunk index.
    Equal to other RankGroups, or to a tuple or list of groups, with the same groups in order.
    """

    members: DeviceRange
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.members, DeviceRange):
            object.__setattr__(self, "members", DeviceRange.of(self.members))
        if self.size < 1 or len(self.members) % self.size:
            raise DeviceSetError(f"rank groups of {self.size} cannot cut {len(self.members)} members")

    @staticmethod
    def of(groups: Iterable[Iterable[int]]) -> RankGroups:
        """Return the rank groups of an explicit list of groups (equal sizes, disjoint)."""
        if isinstance(groups, RankGroups):
            return groups
        groups = [tuple(g) for g in groups]
        sizes = {len(g) for g in groups}
        if len(sizes) != 1 or 0 in sizes:
            raise DeviceSetError(f"rank groups {_groups_list_text(groups)} differ in size or are empty")
        try:
            members = DeviceRange.of([d for g in groups for d in g])
        except DeviceSetError:
            raise DeviceSetError(f"rank groups {_groups_list_text(groups)} overlap") from None
        return RankGroups(members, sizes.pop())

    @staticmethod
    def along(devices: DeviceRange, degrees: Sequence[int], axis: int) -> RankGroups:
        """Return the groups of `devices` laid out over mesh `degrees` (row-major) whose members
        differ only in their coordinate on mesh axis `axis`, ordered by that coordinate; the
        groups come in row-major order of the other coordinates."""
        degrees = tuple(degrees)
        if math.prod(degrees) != len(devices):
            raise DeviceSetError(f"mesh {list(degrees)} does not hold {len(devices)} devices")
        place = _place_values(degrees)
        order = [k for k in range(len(degrees)) if k != axis] + [axis]
        idx = DeviceRange.box(0, [degrees[k] for k in order], [place[k] for k in order])
        return RankGroups(devices.take(idx), degrees[axis])

    def __len__(self) -> int:
        return len(self.members) // self.size

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankGroups):
            return (self.members, self.size) == (other.members, other.size)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(tuple(a) == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        # the hash of the tuple of groups (tuples of ids), as equality with them asks (computed once)
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash(self.as_tuples())
            self.__dict__["_hash"] = h
            return h

    def __getitem__(self, g):  # type: ignore[override]
        if isinstance(g, slice):
            return tuple(self[i] for i in range(*g.indices(len(self))))
        g = operator.index(g)
        if g < 0:
            g += len(self)
        if not 0 <= g < len(self):
            raise IndexError(f"group {g} out of range for {len(self)} groups")
        return self.members.take(DeviceRange.span(g * self.size, self.size)) if self.size > 1 \
            else DeviceRange(self.members[g])

    def __iter__(self) -> Iterator[DeviceRange]:
        return (self[g] for g in range(len(self)))

    def __lt__(self, other: object) -> bool:  # as the listed groups order
        return self.as_tuples() < tuple(tuple(g) for g in other)  # type: ignore[union-attr]

    def group_of(self, rank: int) -> tuple[int, int] | None:
        """Return (group index, position in it) of `rank`, or None when no group holds it."""
        if rank not in self.members:
            return None
        return divmod(self.members.index(rank), self.size)

    def group_holding(self, rank: int) -> DeviceRange | None:
        """Return the group that holds `rank` (None when none does)."""
        where = self.group_of(rank)
        return None if where is None else self[where[0]]

    def as_tuples(self) -> tuple[tuple[int, ...], ...]:
        """Return the groups as tuples of ids (O(members); for what really needs them)."""
        ids = self.members.array().reshape(-1, self.size)
        return tuple(tuple(row) for row in ids.tolist())

    def __str__(self) -> str:
        """Return the canonical text, the shorter of XLA's iota form (`[2,4]<=[8]`) and the list's
        (`{0,2},{1,3}`; ties go to the list)."""
        m = self.members
        text = None
        if m.ids is None and m.shape:
            dims = (len(self), self.size)
            text = _iota_text(dims, m.start, m.shape, m.strides) or _box_text(dims, m.start, m.shape, m.strides)
        if len(m) <= 32 or text is None:
            listed = ",".join("{" + str(g) + "}" for g in self)
            if text is None or len(listed) <= len(text):
                return listed
        return text


def _groups_list_text(groups: Sequence[Sequence[int]]) -> str:
    return ",".join("{" + _list_text(tuple(g)) + "}" for g in groups[:8]) + (",..." if len(groups) > 8 else "")


@dataclass(frozen=True, eq=False)
class RankPairs(Sequence[tuple[int, int]]):
    """The [src, dst] pairs of a send or receive: `src[i]` sends to `dst[i]`, both ranges.

    Text `0-2047->2048-4095` (each side a device set). A rank finds its partner from its id
    (`partner`), not by a search through the pairs.

    >>> p = RankPairs(DeviceRange.iota(4, 4), DeviceRange.iota(4))
    >>> str(p), p.partner(5, "src"), p.partner(1, "dst"), p.partner(1, "src"), list(p)[0]
    ('4-7->0-3', 1, 5, None, (4, 0))
    """

    src: DeviceRange
    dst: DeviceRange

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", DeviceRange.of(self.src))
        object.__setattr__(self, "dst", DeviceRange.of(self.dst))
        if len(self.src) != len(self.dst):
            raise DeviceSetError(f"pairs need as many sources as destinations, got {len(self.src)} and {len(self.dst)}")

    @staticmethod
    def of(pairs: Iterable[Sequence[int]]) -> RankPairs:
        """Return the pairs of an explicit list of [src, dst] pairs."""
        if isinstance(pairs, RankPairs):
            return pairs
        listed = [tuple(p) for p in pairs]
        if not listed or any(len(p) != 2 for p in listed):
            raise DeviceSetError(f"pairs {listed[:8]} are not [src, dst] pairs")
        return RankPairs(DeviceRange.of([p[0] for p in listed]), DeviceRange.of([p[1] for p in listed]))

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(len(self))))
        return self.src[i], self.dst[i]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.src, self.dst)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankPairs):
            return (self.src, self.dst) == (other.src, other.dst)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(tuple(a) == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __lt__(self, other: object) -> bool:  # as the listed pairs order (events sort by them)
        return tuple(self) < tuple(other)  # type: ignore[arg-type]

    def partner(self, rank: int, role: str) -> int | None:
        """Return whom `rank` sends to (`role` "src") or receives from ("dst"); None when it is not one."""
        mine, theirs = (self.src, self.dst) if role == "src" else (self.dst, self.src)
        return theirs[mine.index(rank)] if rank in mine else None

    def members(self) -> DeviceRange:
        """Return every rank of the pairs, the sources first."""
        return concat([self.src, self.dst]) if self.src.isdisjoint(self.dst) else DeviceRange.of(
            sorted(set(self.src) | set(self.dst)))

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


def parse_rank_pairs(text: str) -> RankPairs:
    """Return the pairs `text` names: `0-3->4-7`."""
    body = re.sub(r"\s+", "", text)
    if body.count("->") != 1:
        raise DeviceSetError(f"pairs '{text}': expected SOURCES->DESTINATIONS, e.g. 0-3->4-7")
    src, dst = body.split("->")
    return RankPairs(parse_devices(src), parse_devices(dst))


# ---------------------------------------------------------------------------- parsing

_IOTA = re.compile(r"^\[(?P<dims>\d+(?:,\d+)*)\]<=\[(?P<reshape>\d+(?:,\d+)*)\]"
                   r"(?:T\((?P<perm>\d+(?:,\d+)*)\))?(?:\*(?P<step>\d+))?(?:\+(?P<start>\d+))?$")
_BOX = re.compile(r"^\[(?P<dims>\d+(?:,\d+)*)\]<=\[(?P<shape>\d+(?:,\d+)*)\]@\[(?P<strides>\d+(?:,\d+)*)\]"
                  r"(?:\+(?P<start>\d+))?$")
_ITEM = re.compile(r"^(?P<a>\d+)(?:-(?P<b>\d+)(?::(?P<s>\d+))?)?$")


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in text.split(",")] if text else []


def _iota(text: str) -> tuple[list[int], DeviceRange] | None:
    """Return (dims, the members in row-major order of dims) of an iota expression, or None if `text` is not one."""
    m = _IOTA.match(text)
    if m is None:
        b = _BOX.match(text)
        if b is None:
            return None
        dims, shape, strides = _ints(b["dims"]), _ints(b["shape"]), _ints(b["strides"])
        if len(shape) != len(strides) or math.prod(dims) != math.prod(shape) or 0 in dims:
            raise DeviceSetError(f"box '{text}': needs one stride per dim and dims that hold its devices")
        return dims, DeviceRange.box(int(b["start"] or 0), shape, strides)
    reshape = _ints(m["reshape"])
    return iota_members(_ints(m["dims"]), reshape, _ints(m["perm"]) if m["perm"] else None,
                        int(m["step"] or 1), int(m["start"] or 0), text)


def iota_members(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None = None, step: int = 1,
                 start: int = 0, text: str = "") -> tuple[list[int], DeviceRange]:
    """Return (dims, members) of XLA's `[dims]<=[reshape]T(perm)` scaled by `step` from `start`:
    the ids of iota(prod(reshape)) reshaped to `reshape`, transposed by `perm`, read row-major."""
    dims, reshape = list(dims), list(reshape)
    perm = list(perm) if perm is not None else list(range(len(reshape)))
    text = text or f"[{','.join(map(str, dims))}]<=[{','.join(map(str, reshape))}]"
    if sorted(perm) != list(range(len(reshape))):
        raise DeviceSetError(f"iota '{text}': T({','.join(map(str, perm))}) is not a permutation of "
                             f"the {len(reshape)} reshape dims")
    if math.prod(dims) != math.prod(reshape) or 0 in dims or 0 in reshape or step < 1:
        raise DeviceSetError(f"iota '{text}': dims {dims} and reshape dims {reshape} hold different "
                             "numbers of devices (or none)")
    place = _place_values(reshape)
    return dims, DeviceRange.box(start, [reshape[p] for p in perm], [place[p] * step for p in perm])


def parse_devices(text: str) -> DeviceRange:
    """Return the device set `text` names: `0-3`, `0,2,5`, `3-65531:8`, `[8]<=[2,4]T(1,0)+16`.

    >>> list(parse_devices("0,1,4-6")), list(parse_devices("1-7:3")), list(parse_devices("[4]<=[2,2]T(1,0)"))
    ([0, 1, 4, 5, 6], [1, 4, 7], [0, 2, 1, 3])
    """
    body = re.sub(r"\s+", "", text)
    iota = _iota(body)
    if iota is not None:
        if len(iota[0]) != 1:
            raise DeviceSetError(f"device set '{text}': an iota over {len(iota[0])} dims; a set has one ([n]<=...)")
        return iota[1]
    parts: list[DeviceRange] = []
    for item in body.split(","):
        m = _ITEM.match(item)
        if m is None:
            raise DeviceSetError(f"device set '{text}': '{item}' is not an id, a run a-b or a strided run a-b:s")
        a = int(m["a"])
        b = int(m["b"]) if m["b"] is not None else a
        s = int(m["s"]) if m["s"] is not None else 1
        if b < a or s < 1 or (b - a) % s:
            raise DeviceSetError(f"device set '{text}': run '{item}' runs backwards or its step does not reach its end")
        parts.append(DeviceRange.span(a, (b - a) // s + 1, s))
    return concat(parts)


def concat(parts: Sequence[DeviceRange]) -> DeviceRange:
    """Return the ids of `parts` one after another (a range where they form one: found without
    listing the ids when each part continues the run before it, or the parts are equal ranges at
    a constant offset; else O(ids)).

    >>> str(concat([DeviceRange.iota(4), DeviceRange.iota(4, 4)])), str(concat([DeviceRange.of([0, 1]), DeviceRange.of([4])]))
    ('0-7', '0,1,4')
    """
    runs: list[DeviceRange] = []
    for p in parts:
        last = runs[-1] if runs else None
        if last is not None and last.ids is None and p.ids is None and len(last.shape) <= 1 and len(p.shape) <= 1:
            step = last.strides[0] if last.shape else (p.start - last.start)
            if step > 0 and p.start == last.max + step and (not p.shape or p.strides[0] == step):
                runs[-1] = DeviceRange.span(last.start, len(last) + len(p), step)
                continue
        runs.append(p)
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    if len(runs) > 2 and all(p.ids is None and p.shape == first.shape and p.strides == first.strides for p in runs):
        starts = DeviceRange.of([p.start for p in runs])
        if starts.ids is None and len(starts.shape) == 1:
            try:
                return DeviceRange.box(starts.start, starts.shape + first.shape, starts.strides + first.strides)
            except DeviceSetError:
                pass
    return DeviceRange.of([d for p in runs for d in p])


def parse_rank_groups(text: str) -> RankGroups:
    """Return the rank groups `text` names: `[2,4]<=[8]` (2 groups of 4) or `{0,1},{2,3}`.

    >>> [list(g) for g in parse_rank_groups("[2,2]<=[2,2]T(1,0)")], str(parse_rank_groups("{0,1},{2,3}"))
    ([[0, 2], [1, 3]], '[2,2]<=[4]')
    """
    body = re.sub(r"\s+", "", text)
    iota = _iota(body)
    if iota is not None:
        dims, members = iota
        if len(dims) != 2:
            raise DeviceSetError(f"rank groups '{text}': an iota over {len(dims)} dims; groups take [groups,size]<=...")
        return RankGroups(members, dims[1])
    if not (body.startswith("{") and body.endswith("}")):
        raise DeviceSetError(f"rank groups '{text}': expected [groups,size]<=[...] or {{...}},{{...}}")
    groups = [parse_devices(g) for g in body[1:-1].split("},{")]
    return RankGroups.of(groups)
