"""Text that ships with Python (no download), and the batch generators scripts wrote before `dataset(config)`."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np


def pydoc_text_bytes() -> np.ndarray:
    """Return the English help-topic text of the standard library's pydoc, as bytes (no download)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def lm_windows(data: np.ndarray, batch_size: int, seq_len: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Yield random windows of `data` forever: `ids` [B, T] and the next tokens `targets` [B, T].

    The sequence depends only on the arguments, so every rank and every run sees the same batches.
    """
    if len(data) < seq_len + 2:
        raise ValueError(f"{len(data)} tokens of data are too few for windows of {seq_len + 1}")
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        window = data[starts[:, None] + offsets].astype(np.int32)
        yield {"ids": window[:, :-1], "targets": window[:, 1:]}


def lm_epochs(data: np.ndarray, batch_size: int, seq_len: int, epochs: int | None = None,
              limit: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Yield `data` (its first `limit` tokens) cut into consecutive windows, batch by batch, epoch by epoch.

    Each epoch walks the windows `data[i*T : i*T + T + 1]` in order; its last batch holds the
    windows that are left, so it may have fewer than `batch_size` rows (see
    `hspmd.runtime.data.batching.pad_batch`, which pads it). `epochs=None` repeats forever.
    """
    if limit is not None:
        data = data[:limit]
    count = (len(data) - 1) // seq_len
    if count < 1:
        raise ValueError(f"{len(data)} tokens of data are too few for one window of {seq_len + 1}")
    offsets = np.arange(seq_len + 1)
    epoch = 0
    while epochs is None or epoch < epochs:
        for first in range(0, count, batch_size):
            starts = np.arange(first, min(first + batch_size, count)) * seq_len
            window = data[starts[:, None] + offsets].astype(np.int32)
            yield {"ids": window[:, :-1], "targets": window[:, 1:]}
        epoch += 1


#: standard-library modules whose docstrings `stdlib_documents` reads (importing them has no side effects)
DOC_MODULES = (
    "abc", "argparse", "array", "ast", "base64", "bisect", "calendar", "cmath", "codecs", "collections", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools", "gettext",
    "gzip", "hashlib", "heapq", "hmac", "html", "inspect", "io", "ipaddress", "itertools", "json", "locale",
    "logging", "math", "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched",
    "secrets", "shutil", "socket", "statistics", "string", "struct", "tarfile", "tempfile", "textwrap",
    "threading", "tokenize", "traceback", "types", "typing", "unittest", "uuid", "warnings", "weakref", "zipfile",
)


def stdlib_documents(min_bytes: int = 16) -> list[np.ndarray]:
    """Return real text documents of very unequal length that ship with Python (no download): each
    pydoc help topic, and the docstring of every module of `DOC_MODULES` and of each of its public
    functions, classes and methods, as UTF-8 bytes, in a fixed order, duplicates and texts shorter
    than `min_bytes` left out."""
    import importlib
    import inspect

    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)]
    with warnings.catch_warnings():  # reading some attributes warns of their deprecation (typing.io)
        warnings.simplefilter("ignore")
        for name in DOC_MODULES:
            texts += _docstrings(importlib.import_module(name), inspect)
    seen: set[str] = set()

    out = []
    for t in texts:
        if len(t.encode("utf-8")) >= min_bytes and t not in seen:
            seen.add(t)
            out.append(np.frombuffer(t.encode("utf-8"), dtype=np.uint8))
    return out


def _docstrings(module, inspect) -> list[str]:
    """Return the docstrings of `module` and of its public functions, classes and their methods."""
    texts = [inspect.getdoc(module) or ""]
    for attr in sorted(a for a in vars(module) if not a.startswith("_")):
        obj = getattr(module, attr)
        if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
            continue
        texts.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            texts += [inspect.getdoc(m) or "" for k, m in sorted(vars(obj).items())
                      if not k.startswith("_") and inspect.isfunction(m)]
    return texts


def bucket_of(length: int, buckets: list[int]) -> int:
    """Return the index of the shortest bucket (sequence length) that holds `length` tokens."""
    for i, b in enumerate(buckets):
        if length <= b:
            return i
    raise ValueError(f"a sequence of {length} tokens fits no bucket of {buckets}")


def token_budget_batches(documents: list[np.ndarray], max_tokens: int, buckets: list[int], seed: int,
                         ignore_index: int = -100, only: int | None = None,
                         truncate: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """Yield language-model batches of `documents` by token budget (HetSeq's `max_tokens`), one epoch.

    A document of n bytes gives a sequence of n - 1 next-token pairs, truncated to the longest
    bucket (the model's context; with `truncate=False` cut into pieces of at most that length
    instead); each sequence goes to the shortest bucket (sequence length) `L` that holds it
    and is padded to `L` (`ids` 0, `targets` `ignore_index`, which the loss skips). A batch holds
    `max_tokens // L` rows of one bucket, so every batch carries about `max_tokens` token slots
    whatever its length; batches of different buckets are interleaved in a shuffled order fixed by
    `seed` (every rank sees the same). The last batch of a bucket is filled with padding rows.
    `only`: yield only the batches of that bucket (to trace its program, `data.bucket`; a bucket
    no sequence falls in yields one batch of padding, of its shape).
    """
    longest = max(buckets)
    pieces: list[list[np.ndarray]] = [[] for _ in buckets]
    for doc in documents:
        for start in range(0, max(len(doc) - 1, 0) if not truncate else min(len(doc) - 1, 1), longest):
            piece = doc[start:start + longest + 1]
            if len(piece) >= 2:
                pieces[bucket_of(len(piece) - 1, buckets)].append(piece)
    order: list[tuple[int, int]] = []
    for b, items in enumerate(pieces):
        rows = max(max_tokens // buckets[b], 1)
        order += [(b, first) for first in range(0, len(items), rows)]
    rng = np.random.default_rng(seed)
    rng.shuffle(order)
    if only is not None and not pieces[only]:  # no sequence of that length: one padding batch of its shape
        order = [(only, 0)]
    for b, first in order:
        if only is not None and b != only:
            continue
        length, rows = buckets[b], max(max_tokens // buckets[b], 1)
        ids = np.zeros((rows, length), np.int32)
        targets = np.full((rows, length), ignore_index, np.int32)
        for r, piece in enumerate(pieces[b][first:first + rows]):
            n = len(piece) - 1
            ids[r, :n], targets[r, :n] = piece[:-1], piece[1:]
        yield {"ids": ids, "targets": targets}
