"""Data for model scripts: text that ships with Python, cut into language-model batches."""

from __future__ import annotations

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
    `hspmd.runtime.batching.pad_batch`, which pads it). `epochs=None` repeats forever.
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
