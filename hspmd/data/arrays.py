"""Datasets of rows: NumPy arrays in memory (`ArrayDataset`), and a Hugging Face `datasets` dataset
(`from_hf`: Arrow tables, memory-mapped by that library; needs `pip install datasets`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hspmd.data.errors import DataError

__all__ = ["ArrayDataset", "HFDataset", "from_hf"]


class ArrayDataset:
    """Rows of equally long arrays held in memory: sample i is row i of every column.

        ArrayDataset({"x": features, "y": labels})   # read([3, 1]) -> {"x": features[[3, 1]], ...}
    """

    def __init__(self, columns: Mapping[str, np.ndarray], pad: Mapping[str, object] | None = None) -> None:
        if not columns:
            raise DataError("an ArrayDataset needs at least one column")
        self.columns = {k: np.asarray(v) for k, v in columns.items()}
        sizes = {k: v.shape[0] if v.ndim else None for k, v in self.columns.items()}
        if None in sizes.values() or len(set(sizes.values())) != 1:
            raise DataError(f"the columns must have the same number of rows (dim 0): {sizes}")
        self.size = next(iter(sizes.values()))
        self.pad = dict(pad or {})

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"ArrayDataset({self.size} rows of {', '.join(f'{k} {list(v.shape[1:])}' for k, v in self.columns.items())})"

    def read(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and not (0 <= indices.min() and indices.max() < self.size):
            raise DataError(f"row indices {indices.min()}..{indices.max()} are outside the {self.size} rows")
        return {k: v[indices] for k, v in self.columns.items()}


class HFDataset:
    """A Hugging Face `datasets.Dataset` as an `hspmd.data` dataset: `read` takes its rows by index
    (the library reads them from its memory-mapped Arrow files) as NumPy arrays of `columns`."""

    def __init__(self, dataset, columns: Sequence[str] | None = None, pad: Mapping[str, object] | None = None) -> None:
        names = list(getattr(dataset, "column_names", None) or [])
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__") or not names:
            raise DataError(f"from_hf takes a datasets.Dataset (a table with column_names), got {type(dataset).__name__}")
        self.columns = list(columns) if columns is not None else names
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise DataError(f"the dataset has no column {', '.join(map(repr, missing))} (it has {', '.join(names)})")
        self.dataset = dataset.with_format("numpy", columns=self.columns) if hasattr(dataset, "with_format") else dataset
        self.pad = dict(pad or {})

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return f"HFDataset({len(self)} rows of {', '.join(self.columns)})"

    def read(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and not (0 <= indices.min() and indices.max() < len(self)):
            raise DataError(f"row indices {indices.min()}..{indices.max()} are outside the {len(self)} rows")
        rows = self.dataset[indices.tolist()]
        out = {}
        for c in self.columns:
            value = rows[c]
            try:
                out[c] = np.stack([np.asarray(v) for v in value]) if isinstance(value, list) else np.asarray(value)
            except ValueError:
                raise DataError(f"column '{c}' holds rows of different shapes: give a collate that pads them, or a "
                                "dataset of fixed-length rows") from None
        return out


def from_hf(dataset, columns: Sequence[str] | None = None, pad: Mapping[str, object] | None = None) -> HFDataset:
    """Return a Hugging Face `datasets.Dataset` (its `columns`, default all) as an `hspmd.data` dataset."""
    return HFDataset(dataset, columns, pad)
