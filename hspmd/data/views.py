"""The datasets a token corpus gives (`hspmd.data.corpus.TokenCorpus`: its `windows`, `documents`,
`packed`): fixed windows, whole documents, documents packed into windows.

Each is a dataset (`len`, `read(indices)` -> a dict of arrays, one row per index) whose rows are
language-model pairs; `pad` says what a padding row holds (a target the loss ignores).
"""

from __future__ import annotations

import numpy as np

from hspmd.data.errors import DataError

__all__ = ["Windows", "Documents", "Packed", "IGNORE_INDEX"]

#: the target of a position without one (padding, a document's end in a packed window): the loss skips it
IGNORE_INDEX = -100


def _model_vocab(corpus, vocab_size: int | None) -> int:
    """Return the ids' bound: the model's vocabulary, checked against what the corpus's index says."""
    if vocab_size is None:
        return corpus.vocab_size
    index = getattr(corpus, "index", None)
    if index is not None:
        import os

        for shard in index.shards:
            if shard.max_id >= vocab_size:
                raise DataError(f"{os.path.join(corpus.path, shard.file)}: token id {shard.max_id} is at or above the "
                                f"model's vocabulary ({vocab_size}; the dataset's is {corpus.vocab_size})")
    return int(vocab_size)


class Windows:
    """Windows of `length` tokens every `stride` tokens of a corpus's stream: rows `ids` and `targets`
    (int32, `length - 1` each, the targets one token on)."""

    def __init__(self, corpus, length: int, stride: int | None = None,
                 vocab_size: int | None = None) -> None:
        if length < 2:
            raise DataError(f"a window of {length} tokens holds no next-token pair (at least 2)")
        self.corpus, self.length = corpus, int(length)
        self.stride = int(stride if stride is not None else length - 1)
        if self.stride < 1:
            raise DataError(f"window stride {self.stride}: at least 1")
        self.vocab_size = _model_vocab(corpus, vocab_size)
        if corpus.num_tokens < self.length:
            raise DataError(f"the corpus has {corpus.num_tokens} tokens, too few for one window of {self.length}")
        self.pad = {"ids": 0, "targets": IGNORE_INDEX}

    def __len__(self) -> int:
        return (self.corpus.num_tokens - self.length) // self.stride + 1

    def __repr__(self) -> str:
        return f"Windows({len(self)} of {self.length} tokens every {self.stride}, of {self.corpus!r})"

    def read(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and not (0 <= indices.min() and indices.max() < len(self)):
            raise DataError(f"window indices {indices.min()}..{indices.max()} are outside the {len(self)} windows")
        rows = self.corpus.read_rows(indices * self.stride, self.length, self.vocab_size).astype(np.int32)
        return {"ids": np.ascontiguousarray(rows[:, :-1]), "targets": np.ascontiguousarray(rows[:, 1:])}


class Documents:
    """Whole documents, of their own lengths: `read` gives `tokens`, a list of int32 arrays."""

    def __init__(self, corpus, vocab_size: int | None = None) -> None:
        self.corpus, self.vocab_size = corpus, _model_vocab(corpus, vocab_size)
        if corpus.num_documents < 1:
            raise DataError("the corpus has no documents")

    def __len__(self) -> int:
        return self.corpus.num_documents

    def lengths(self) -> np.ndarray:
        """Return every document's length in tokens."""
        return self.corpus.document_lengths()

    def read(self, indices) -> dict[str, list[np.ndarray]]:
        spans = self.corpus.document_spans(indices)
        out = []
        for a, b in spans:
            row = self.corpus.read_rows(np.array([a]), int(b - a), self.vocab_size)[0] if b > a else \
                np.zeros(0, self.corpus.dtype)
            out.append(row.astype(np.int32))
        return {"tokens": out}


class Packed:
    """Documents packed into windows of `length` tokens (see `TokenCorpus.packed`).

    The packing is found once, from the document lengths (8 bytes a document): documents in corpus
    order, each window holding the next ones while they fit; a document longer than a window is cut
    into windows of its own, overlapping by one token so that each of its targets is learnt once.
    """

    def __init__(self, corpus, length: int, vocab_size: int | None = None,
                 ignore_index: int = IGNORE_INDEX) -> None:
        if length < 2:
            raise DataError(f"a packed window of {length} tokens holds no next-token pair (at least 2)")
        self.corpus, self.length, self.ignore_index = corpus, int(length), ignore_index
        self.vocab_size = _model_vocab(corpus, vocab_size)
        self.pad = {"ids": 0, "targets": ignore_index, "segments": -1.0}
        self._pieces, self._first = self._pack(corpus)
        if len(self._first) < 2:
            raise DataError("the corpus has no tokens to pack")

    def _pack(self, corpus) -> tuple[np.ndarray, np.ndarray]:
        """Return the pieces ([n, 2]: stream start, length; consecutive pieces of one window are
        whole documents or one cut of a long one) and where each window's pieces begin."""
        lengths = corpus.document_lengths().astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
        size, step = self.length, self.length - 1
        pieces: list[tuple[int, int]] = []
        first = [0]
        fill = 0
        for s, n in zip(starts.tolist(), lengths.tolist()):
            if n == 0:
                continue
            if n > size:  # windows of its own
                if fill:
                    first.append(len(pieces))
                    fill = 0
                for cut in range(0, n - 1, step):
                    pieces.append((s + cut, min(size, n - cut)))
                    first.append(len(pieces))
                continue
            if fill + n > size:
                first.append(len(pieces))
                fill = 0
            pieces.append((s, n))
            fill += n
        if fill:
            first.append(len(pieces))
        return np.asarray(pieces, dtype=np.int64).reshape(-1, 2), np.asarray(first, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._first) - 1

    def __repr__(self) -> str:
        return f"Packed({len(self)} windows of {self.length} tokens, of {self.corpus!r})"

    def read(self, indices) -> dict[str, np.ndarray]:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and not (0 <= indices.min() and indices.max() < len(self)):
            raise DataError(f"packed window indices {indices.min()}..{indices.max()} are outside the {len(self)}")
        n, t = len(indices), self.length
        tokens = np.zeros((n, t), np.int32)
        segment = np.full((n, t), -1, np.int32)
        for r, w in enumerate(indices):
            at = 0
            for seg, (start, count) in enumerate(self._pieces[self._first[w]:self._first[w + 1]]):
                tokens[r, at:at + count] = self.corpus.read_rows(np.array([start]), int(count), self.vocab_size)[0]
                segment[r, at:at + count] = seg
                at += count
        targets = tokens[:, 1:].copy()
        targets[(segment[:, 1:] != segment[:, :-1]) | (segment[:, 1:] < 0)] = self.ignore_index
        return {"ids": np.ascontiguousarray(tokens[:, :-1]), "targets": targets,
                "segments": segment[:, :-1].astype(np.float32)}  # float: a model computes its mask from them
