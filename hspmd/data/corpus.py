"""Token corpora: a stream of token ids cut into documents, on disk (`TokenDataset`) or in memory
(`tokens`), and the datasets read from one (`Windows`, `Documents`, `Packed` in `views.py`).

A dataset of `hspmd.data` is anything with `len(ds)` samples and `ds.read(indices)`, which returns
the samples at those indices as a dict of arrays with one row per index. Reading a few rows costs
what they hold, never the corpus: the on-disk corpus reads each row with one positioned read
(`os.preadv`) straight into the batch's array. (A memory map, Megatron's and nanoGPT's way, would
do as well per read, but every page a rank touches then counts in its resident memory for the rest
of the run, which over a long run grows to the corpus; a positioned read leaves the pages in the
kernel's page cache, shared and reclaimable.)
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np

from hspmd.data.errors import DataError
from hspmd.data.format import OFFSET_DTYPE, DatasetIndex, check_shard_files, crc32_file, read_index

__all__ = ["TokenCorpus", "TokenDataset", "MemoryTokens", "tokens"]


class TokenCorpus:
    """A stream of token ids (documents one after another) and where each document starts.

    Subclasses give `_read(start, out)` (the stream's tokens from `start` into `out`), the stream's
    length and the document table; the views (`windows`, `documents`, `packed`) are the datasets.
    """

    #: ids are below this (the tokenizer's vocabulary)
    vocab_size: int
    #: the end-of-document id appended to every document, or None
    eod: int | None
    dtype: np.dtype

    def __init__(self) -> None:
        #: bytes of tokens read so far (what the benchmark's "bytes read per rank" counts)
        self.bytes_read = 0
        self._lock = threading.Lock()

    # what a corpus provides
    @property
    def num_tokens(self) -> int:
        raise NotImplementedError

    @property
    def num_documents(self) -> int:
        raise NotImplementedError

    def _read(self, start: int, out: np.ndarray) -> None:
        raise NotImplementedError

    def document_spans(self, indices: np.ndarray) -> np.ndarray:
        """Return [n, 2]: the stream range [start, stop) of each document of `indices`."""
        raise NotImplementedError

    def where(self, position: int) -> str:
        """Return the file (or "memory") that holds stream position `position`, for messages."""
        return "the in-memory tokens"

    # reading
    def read_rows(self, starts: np.ndarray, length: int, limit: int | None = None) -> np.ndarray:
        """Return [n, length] tokens (the corpus dtype): row r is the stream's `starts[r]` onwards.

        Ids at or above `limit` (default: the vocabulary) raise DataError naming the file that holds one.
        """
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        out = np.empty((len(starts), length), self.dtype)
        for r, s in enumerate(starts):
            if s < 0 or s + length > self.num_tokens:
                raise DataError(f"tokens {s}..{s + length} are outside the corpus of {self.num_tokens} tokens")
            self._read(int(s), out[r])
        with self._lock:
            self.bytes_read += out.nbytes
        self.check_ids(out, starts, limit)
        return out

    def check_ids(self, rows: np.ndarray, starts: np.ndarray, limit: int | None = None) -> None:
        """Raise DataError if a token of `rows` (read from `starts`) is at or above `limit` (the vocabulary)."""
        limit = self.vocab_size if limit is None else limit
        if rows.size == 0 or int(rows.max()) < limit:
            return
        r, c = (int(x[0]) for x in np.nonzero(rows >= limit))
        position = int(starts[r]) + c
        raise DataError(f"{self.where(position)}: token id {int(rows[r, c])} at stream position {position} is at or "
                        f"above the vocabulary ({limit}): a corrupt shard, or a dataset of another tokenizer")

    # the datasets a corpus gives
    def windows(self, length: int, stride: int | None = None, vocab_size: int | None = None):
        """Return the dataset of windows of `length` tokens every `stride` (default `length - 1`: each
        token is a target once per epoch), across document boundaries, as language-model rows `ids`
        (the first `length - 1` tokens) and `targets` (the last `length - 1`). `vocab_size`: the
        model's vocabulary (default the corpus's); a larger id is an error naming its shard."""
        from hspmd.data.views import Windows

        return Windows(self, length, stride, vocab_size)

    def documents(self, vocab_size: int | None = None):
        """Return the dataset of whole documents (variable length: `read` gives `tokens`, a list)."""
        from hspmd.data.views import Documents

        return Documents(self, vocab_size)

    def packed(self, length: int, vocab_size: int | None = None, ignore_index: int = -100):
        """Return the dataset of documents packed into windows of `length` tokens (HetSeq, Megatron's
        packed sequences): each window holds whole documents in order while they fit (a longer one is
        cut into window-sized pieces), padded at its end; rows `ids`, `targets` (`ignore_index` where
        no next token of the same document exists) and `segments` (float32: which document of the
        window a position belongs to, -1 for padding), for a model that keeps attention within
        documents (`GPTConfig.document_mask`)."""
        from hspmd.data.views import Packed

        return Packed(self, length, vocab_size, ignore_index)


class TokenDataset(TokenCorpus):
    """A prepared token dataset on disk (`hspmd data prepare`, `hspmd.data.format`).

    Opening checks the index and every shard's size against it (a truncated or grown shard, or an
    index of another dataset, is a DataError naming the file); `verify=True` also checks each
    shard's CRC-32 (reads the whole corpus once, without keeping it). `vocab_size` (the model's)
    must exceed every shard's largest id.
    """

    def __init__(self, path: str, verify: bool = False, max_open: int = 64) -> None:
        super().__init__()
        self.path = os.path.abspath(path)
        self.index: DatasetIndex = read_index(self.path)
        self.vocab_size, self.eod, self.dtype = self.index.vocab_size, self.index.eod, np.dtype(self.index.dtype)
        self.dtype = self.dtype.newbyteorder("<")
        for shard in self.index.shards:
            check_shard_files(self.path, self.index, shard)
        if verify:
            self.verify()
        counts = [s.tokens for s in self.index.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._doc_starts = np.concatenate([[0], np.cumsum([s.documents for s in self.index.shards], dtype=np.int64)])
        self._files: OrderedDict[str, int] = OrderedDict()
        self._max_open = max_open

    def __repr__(self) -> str:
        return (f"TokenDataset({self.path!r}: {self.num_documents} documents, {self.num_tokens} tokens, "
                f"{len(self.index.shards)} shards, vocabulary {self.vocab_size})")

    @property
    def num_tokens(self) -> int:
        return int(self._starts[-1])

    @property
    def num_documents(self) -> int:
        return int(self._doc_starts[-1])

    def verify(self, shards=None) -> None:
        """Check the CRC-32 of every shard's tokens and document table (or of `shards`, indices)."""
        for k in range(len(self.index.shards)) if shards is None else shards:
            s = self.index.shards[k]
            for name, want in ((s.file, s.crc32), (s.index, s.index_crc32)):
                got = crc32_file(os.path.join(self.path, name))
                if got != want:
                    raise DataError(f"{os.path.join(self.path, name)}: fails its checksum (CRC-32 {got:08x}, the "
                                    f"index says {want:08x}): the file is corrupt")

    def _fd(self, name: str) -> int:
        """Return an open descriptor of file `name` (kept open, at most `max_open` at once)."""
        with self._lock:
            fd = self._files.get(name)
            if fd is not None:
                self._files.move_to_end(name)
                return fd
            fd = os.open(os.path.join(self.path, name), os.O_RDONLY)
            self._files[name] = fd
            while len(self._files) > self._max_open:
                os.close(self._files.popitem(last=False)[1])
            return fd

    def close(self) -> None:
        """Close the files this dataset holds open (it reopens them when read again)."""
        with self._lock:
            while self._files:
                os.close(self._files.popitem()[1])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def _pread(self, name: str, out: np.ndarray, offset: int) -> None:
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):  # a read may return fewer bytes than asked
            n = os.preadv(self._fd(name), [view[done:]], offset + done)
            if n <= 0:
                raise DataError(f"{os.path.join(self.path, name)}: ends at byte {offset + done}, before the index "
                                "says it does (truncated while in use?)")
            done += n

    def read_rows(self, starts: np.ndarray, length: int, limit: int | None = None) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() + length > self.num_tokens):
            raise DataError(f"tokens {starts.min()}..{starts.max() + length} are outside the corpus of "
                            f"{self.num_tokens} tokens")
        out = np.empty((len(starts), length), self.dtype)
        shards = np.searchsorted(self._starts, starts, "right") - 1
        ends = self._starts[shards + 1]
        item, nbytes = self.dtype.itemsize, length * self.dtype.itemsize
        view = memoryview(out.reshape(-1).view(np.uint8))
        fds: dict[int, int] = {}
        for r, (s, k, end) in enumerate(zip(starts.tolist(), shards.tolist(), ends.tolist())):
            if s + length > end:  # the row runs on into the next shard
                self._read(s, out[r])
                continue
            fd = fds.get(k)
            if fd is None:
                fd = fds[k] = self._fd(self.index.shards[k].file)
            offset = (s - int(self._starts[k])) * item
            if os.preadv(fd, [view[r * nbytes:(r + 1) * nbytes]], offset) != nbytes:  # the usual case: one read
                self._pread(self.index.shards[k].file, out[r], offset)
        with self._lock:
            self.bytes_read += out.nbytes
        self.check_ids(out, starts, limit)
        return out

    def _read(self, start: int, out: np.ndarray) -> None:
        k = int(np.searchsorted(self._starts, start, "right")) - 1
        done = 0
        while done < len(out):  # a row may run on into the next shards
            shard, first = self.index.shards[k], start + done - int(self._starts[k])
            take = min(len(out) - done, shard.tokens - first)
            self._pread(shard.file, out[done:done + take], first * self.dtype.itemsize)
            done += take
            k += 1

    def where(self, position: int) -> str:
        k = int(np.searchsorted(self._starts, position, "right")) - 1
        return os.path.join(self.path, self.index.shards[min(k, len(self.index.shards) - 1)].file)

    def document_spans(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((len(indices), 2), np.int64)
        pair = np.empty(2, OFFSET_DTYPE)
        for r, i in enumerate(indices):
            if not 0 <= i < self.num_documents:
                raise DataError(f"document {i} is outside the corpus of {self.num_documents} documents")
            k = int(np.searchsorted(self._doc_starts, i, "right")) - 1
            shard, local = self.index.shards[k], int(i - self._doc_starts[k])
            self._pread(shard.index, pair, local * OFFSET_DTYPE.itemsize)
            a, b = int(pair[0]), int(pair[1])
            if not 0 <= a <= b <= shard.tokens:
                raise DataError(f"{os.path.join(self.path, shard.index)}: document {local} spans tokens {a}..{b}, "
                                f"outside the shard's {shard.tokens} (a corrupt document table)")
            out[r] = (a + self._starts[k], b + self._starts[k])
        return out

    def document_lengths(self) -> np.ndarray:
        """Return every document's length (reads every shard's document table: 8 bytes a document)."""
        parts = []
        for shard in self.index.shards:
            offsets = np.empty(shard.documents + 1, OFFSET_DTYPE)
            self._pread(shard.index, offsets, 0)
            lengths = np.diff(offsets.astype(np.int64))
            if (lengths < 0).any() or int(offsets[-1]) != shard.tokens:
                raise DataError(f"{os.path.join(self.path, shard.index)}: its document offsets do not rise from 0 "
                                f"to the shard's {shard.tokens} tokens (a corrupt document table)")
            parts.append(lengths)
        return np.concatenate(parts)


class MemoryTokens(TokenCorpus):
    """A token corpus held in memory (tests, small text that ships with Python): the same datasets as a
    `TokenDataset`. `offsets`: where each document starts, with the end last (default: one document)."""

    def __init__(self, ids, offsets=None, vocab_size: int | None = None, eod: int | None = None) -> None:
        super().__init__()
        self.ids = np.ascontiguousarray(ids).reshape(-1)
        if not np.issubdtype(self.ids.dtype, np.integer):
            raise DataError(f"token ids must be integers, got {self.ids.dtype}")
        if self.ids.size and int(self.ids.min()) < 0:
            raise DataError("token ids must not be negative")
        self.dtype = self.ids.dtype
        self.vocab_size = int(vocab_size if vocab_size is not None else (int(self.ids.max()) + 1 if self.ids.size else 1))
        self.eod = eod
        self.offsets = np.asarray([0, self.ids.size] if offsets is None else offsets, dtype=np.int64)
        if self.offsets[0] != 0 or self.offsets[-1] != self.ids.size or (np.diff(self.offsets) < 0).any():
            raise DataError(f"document offsets must rise from 0 to the {self.ids.size} tokens")

    @property
    def num_tokens(self) -> int:
        return int(self.ids.size)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    def _read(self, start: int, out: np.ndarray) -> None:
        out[...] = self.ids[start:start + len(out)]

    def document_spans(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if indices.size and not (0 <= indices.min() and indices.max() < self.num_documents):
            raise DataError(f"documents {indices.tolist()} are outside the corpus of {self.num_documents}")
        return np.stack([self.offsets[indices], self.offsets[indices + 1]], axis=1)

    def document_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def tokens(ids, documents=None, vocab_size: int | None = None, eod: int | None = None) -> MemoryTokens:
    """Return an in-memory token corpus of `ids` (1-D integers). `documents`: a list of arrays (their
    concatenation is the stream, each one a document) instead of `ids` when `ids` is None."""
    if documents is not None:
        lengths = [len(d) for d in documents]
        ids = np.concatenate([np.asarray(d).reshape(-1) for d in documents]) if documents else np.zeros(0, np.int64)
        return MemoryTokens(ids, np.concatenate([[0], np.cumsum(lengths)]), vocab_size, eod)
    return MemoryTokens(ids, None, vocab_size, eod)
