"""A pseudo-random permutation of [0, n) that is computed one element at a time, in O(1) memory.

Shuffling an epoch of 15 million windows with `rng.permutation` holds 120 MB per rank and takes
its time at every epoch and every resume; here the epoch's order is a keyed bijection instead
(a balanced Feistel network on the smallest even number of bits that covers n, walked until it
lands inside [0, n): "cycle walking", the standard way to restrict a permutation of a power of
two to any n). `permute(positions, n, key)` gives the images of just the positions a batch
needs, so a global batch k is a pure function of (seed, epoch, k) that any rank evaluates alone.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["permute"]

ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """Return splitmix64's finalizer of each element (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << np.uint64(half)) | right


def _round_keys(key, count: int) -> np.ndarray:
    """Return `count` round keys for `key` = (seed, stream...): the state of NumPy's
    `SeedSequence(seed, spawn_key=stream)`, child `stream` of the seed (how NumPy derives
    independent streams from one seed; its output is fixed across versions and machines)."""
    return _keys(tuple(int(k) for k in key), count)


@lru_cache(maxsize=64)  # a pure function's memo: an epoch's batches share their keys (0.1 ms to derive)
def _keys(key: tuple[int, ...], count: int) -> np.ndarray:
    seed, *stream = key
    keys = np.random.SeedSequence(seed, spawn_key=tuple(stream)).generate_state(count, np.uint64)
    keys.flags.writeable = False
    return keys


def permute(positions, n: int, key) -> np.ndarray:
    """Return where the permutation of [0, n) chosen by `key` (non-negative ints: (seed, epoch))
    sends each of `positions` (int64, each in [0, n)).

    The same key gives the same permutation on every machine; another key gives another one.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if n < 1 or (positions.size and (positions.min() < 0 or positions.max() >= n)):
        raise ValueError(f"positions must lie in [0, {n})")
    if n <= 2:  # nothing to shuffle with fewer than three (a two-element swap by the key's parity)
        flip = int(_round_keys(key, 1)[0]) & 1 if n == 2 else 0
        return positions ^ flip
    bits = int(n - 1).bit_length()
    half = (bits + 1) // 2
    keys = _round_keys(key, ROUNDS)
    out = _feistel(positions.astype(np.uint64).reshape(-1), half, keys)
    outside = out >= np.uint64(n)
    while outside.any():  # at most 4n / n = 4 walks expected, whatever n
        out[outside] = _feistel(out[outside], half, keys)
        outside = out >= np.uint64(n)
    return out.astype(np.int64).reshape(positions.shape)
