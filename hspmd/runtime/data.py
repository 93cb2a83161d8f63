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
