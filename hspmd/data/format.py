"""The on-disk token dataset: shards of token ids and an index, as `hspmd data prepare` writes them.

A dataset is a directory:

    index.json          what the dataset holds (below), written last
    shard-00000.bin     token ids, little-endian uint16 (a vocabulary of at most 65,536) or uint32
    shard-00000.idx     where each document of the shard starts: little-endian uint64, documents + 1
                        offsets into the shard's tokens (the first 0, the last the shard's tokens)
    tokenizer.json      the tokenizer (a BPE's or a given one; absent for bytes)

`index.json`:

    {"format": "hspmd-tokens", "version": 1, "dtype": "uint16", "vocab_size": 512, "eod": 0,
     "tokenizer": "bpe", "tokenizer_file": "tokenizer.json", "documents": 120, "tokens": 183220,
     "shards": [{"file": "shard-00000.bin", "index": "shard-00000.idx", "tokens": 91610,
                 "documents": 60, "max_id": 511, "crc32": 305419896, "index_crc32": 19088743}]}

`eod` is the end-of-document id the tokenizer appended to every document (null: none). The
tokens are Megatron's and nanoGPT's layout (a flat array of ids, read by memory map); the
document offsets are a binary array rather than JSON, so that a corpus of a million documents
costs no memory until its documents are asked for. `crc32` is zlib's CRC-32 of a shard's bytes.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np

from hspmd.data.errors import DataError

FORMAT = "hspmd-tokens"
VERSION = 1
INDEX = "index.json"
TOKENIZER = "tokenizer.json"
DTYPES = ("uint16", "uint32")
OFFSET_DTYPE = np.dtype("<u8")

__all__ = ["DatasetIndex", "ShardEntry", "INDEX", "TOKENIZER", "token_dtype", "read_index", "write_index",
           "crc32_file", "shard_names", "check_shard_files"]


def token_dtype(vocab_size: int) -> str:
    """Return the narrowest dtype of `DTYPES` that holds ids below `vocab_size`."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_names(k: int) -> tuple[str, str]:
    """Return the file names of shard `k`: its tokens and its document offsets."""
    return f"shard-{k:05d}.bin", f"shard-{k:05d}.idx"


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the index describes it."""

    file: str
    index: str
    tokens: int
    documents: int
    max_id: int
    crc32: int
    index_crc32: int


@dataclass(frozen=True)
class DatasetIndex:
    """What `index.json` says a dataset holds."""

    dtype: str
    vocab_size: int
    eod: int | None
    tokenizer: str
    shards: tuple[ShardEntry, ...] = field(default_factory=tuple)
    tokenizer_file: str | None = None

    @property
    def tokens(self) -> int:
        """Return the tokens of every shard."""
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        """Return the documents of every shard."""
        return sum(s.documents for s in self.shards)

    def to_json(self) -> str:
        """Return the index as the text of `index.json`."""
        head = {"format": FORMAT, "version": VERSION, "dtype": self.dtype, "vocab_size": self.vocab_size,
                "eod": self.eod, "tokenizer": self.tokenizer, "tokenizer_file": self.tokenizer_file,
                "documents": self.documents, "tokens": self.tokens}
        shards = ",\n".join("  " + json.dumps(asdict(s)) for s in self.shards)
        fields = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()]
        return "{\n" + ",\n".join([*fields, ' "shards": [\n' + shards + "\n ]"]) + "\n}\n"


def read_index(directory: str) -> DatasetIndex:
    """Return the index of the dataset in `directory`; DataError naming the file if it is not one."""
    path = os.path.join(directory, INDEX)
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: no such dataset directory (make one with 'hspmd data prepare')")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: missing: {directory} is not a prepared dataset (hspmd data prepare)") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: not a readable JSON index ({type(err).__name__}: {err})") from None
    try:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise DataError(f"{path}: not an hspmd token dataset index (format {d.get('format')!r})")
        if d.get("version") != VERSION:
            raise DataError(f"{path}: index version {d.get('version')!r}; this hspmd reads {VERSION}")
        shards = tuple(ShardEntry(str(s["file"]), str(s["index"]), int(s["tokens"]), int(s["documents"]),
                                  int(s["max_id"]), int(s["crc32"]), int(s["index_crc32"])) for s in d["shards"])
        index = DatasetIndex(str(d["dtype"]), int(d["vocab_size"]), None if d.get("eod") is None else int(d["eod"]),
                             str(d.get("tokenizer", "")), shards,
                             None if d.get("tokenizer_file") is None else str(d["tokenizer_file"]))
    except DataError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise DataError(f"{path}: malformed index ({type(err).__name__}: {err})") from None
    _check_index(index, path)
    return index


def _check_index(index: DatasetIndex, path: str) -> None:
    """Raise DataError where the index contradicts itself (dtype, vocabulary, counts, file names)."""
    if index.dtype not in DTYPES:
        raise DataError(f"{path}: dtype {index.dtype!r}; a token dataset holds {' or '.join(DTYPES)}")
    if not 1 <= index.vocab_size <= np.iinfo(index.dtype).max + 1:
        raise DataError(f"{path}: vocabulary {index.vocab_size} does not fit its dtype {index.dtype}")
    if index.eod is not None and not 0 <= index.eod < index.vocab_size:
        raise DataError(f"{path}: end-of-document id {index.eod} is outside the vocabulary ({index.vocab_size})")
    if not index.shards:
        raise DataError(f"{path}: the dataset has no shards")
    for s in index.shards:
        for name in (s.file, s.index):
            if os.path.basename(name) != name or not name:
                raise DataError(f"{path}: shard file {name!r} is not a plain file name in the dataset directory")
        if s.tokens < 0 or s.documents < 0 or (s.documents == 0) != (s.tokens == 0):
            raise DataError(f"{path}: {s.file}: {s.tokens} tokens in {s.documents} documents")
        if not -1 <= s.max_id < index.vocab_size:
            raise DataError(f"{s.file}: token id {s.max_id} is at or above the vocabulary ({index.vocab_size}), "
                            f"says {path}")


def check_shard_files(directory: str, index: DatasetIndex, shard: ShardEntry) -> None:
    """Raise DataError naming the shard where its files disagree with the index in size or bounds
    (a truncated or grown shard, a document table that does not span its tokens): O(1) per shard."""
    item = np.dtype(index.dtype).itemsize
    tokens_path, offsets_path = os.path.join(directory, shard.file), os.path.join(directory, shard.index)
    for path, want, what in ((tokens_path, shard.tokens * item, f"{shard.tokens} tokens of {index.dtype}"),
                             (offsets_path, (shard.documents + 1) * OFFSET_DTYPE.itemsize,
                              f"{shard.documents + 1} document offsets")):
        try:
            size = os.path.getsize(path)
        except OSError:
            raise DataError(f"{path}: missing (the index lists it)") from None
        if size != want:
            state = "truncated" if size < want else "longer than its index says"
            raise DataError(f"{path}: {state}: {size} bytes, the index says {what} ({want} bytes)")
    if shard.documents:
        with open(offsets_path, "rb") as f:
            first = int(np.frombuffer(f.read(8), OFFSET_DTYPE)[0])
            f.seek(-8, os.SEEK_END)
            last = int(np.frombuffer(f.read(8), OFFSET_DTYPE)[0])
        if first != 0 or last != shard.tokens:
            raise DataError(f"{offsets_path}: its documents span tokens {first}..{last}, the shard holds {shard.tokens}")


def crc32_file(path: str, chunk: int = 1 << 22) -> int:
    """Return zlib's CRC-32 of the file at `path` (read in chunks: nothing stays in memory)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                return crc
            crc = zlib.crc32(view[:n], crc)


def write_index(directory: str, index: DatasetIndex) -> None:
    """Write `index.json` into `directory` atomically (the dataset exists once it is there)."""
    path = os.path.join(directory, INDEX)
    with open(path + ".part", "w", encoding="utf-8") as f:
        f.write(index.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)
