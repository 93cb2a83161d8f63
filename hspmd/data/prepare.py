"""`hspmd data prepare`: text files into a token dataset (`format.py`), shards written in parallel.

    prepare(["a.txt", "b.txt"], "bpe:8192", "ds")

Documents: a `.jsonl` file holds one per line (its `text` field); another file is one document
(`split="file"`, the default), one per paragraph (`"blank"`: separated by blank lines) or one per
line (`"line"`). The documents are cut, in order, into shards of about `shard_bytes` of text;
threads tokenize and write the shards (the tokenizers release the GIL), a progress bar counts
the text done, and `index.json` is written last, after which the directory takes its name in
one rename: a dataset directory that exists is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hspmd.data.errors import DataError
from hspmd.data.format import OFFSET_DTYPE, TOKENIZER, DatasetIndex, ShardEntry, shard_names, token_dtype, write_index
from hspmd.data.tokenizer import make_tokenizer

__all__ = ["prepare", "read_documents", "SPLITS"]

SPLITS = ("file", "blank", "line")


def _text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: a directory, not a text file") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise DataError(f"{path}: {err.strerror or err}") from None


def read_documents(files: list[str], split: str = "file", text_key: str = "text") -> Iterator[tuple[str, int]]:
    """Yield (document, bytes of input it stands for) of `files`, in order (see the module docstring)."""
    if split not in SPLITS:
        raise DataError(f"--split {split}: expected one of {', '.join(SPLITS)}")
    for path in files:
        text = _text(path)
        size = len(text.encode("utf-8"))
        if path.endswith(".jsonl"):
            lines = text.splitlines()
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)[text_key]
                except (ValueError, KeyError, TypeError) as err:
                    raise DataError(f"{path}:{number}: not a JSON object with a '{text_key}' string "
                                    f"({type(err).__name__})") from None
                if not isinstance(doc, str):
                    raise DataError(f"{path}:{number}: '{text_key}' is not a string")
                yield doc, len(line) + 1
            continue
        if split == "file":
            parts = [text]
        elif split == "line":
            parts = text.splitlines()
        else:
            parts = [p for p in text.split("\n\n")]
        parts = [p for p in parts if p.strip()]
        for p in parts:
            yield p, max(size // max(len(parts), 1), 1)


def _chunks(documents: Iterator[tuple[str, int]], shard_bytes: int) -> Iterator[tuple[list[str], int]]:
    """Yield runs of documents of about `shard_bytes` of text each (a shard's worth), in order."""
    docs: list[str] = []
    size = weight = 0
    for doc, w in documents:
        docs.append(doc)
        size += len(doc)
        weight += w
        if size >= shard_bytes:
            yield docs, weight
            docs, size, weight = [], 0, 0
    if docs:
        yield docs, weight


def _write_shard(directory: str, k: int, docs: list[str], tokenizer, dtype: str) -> ShardEntry:
    """Tokenize `docs` and write them as shard `k` of the dataset in `directory`; return its entry."""
    ids = tokenizer.encode_batch(docs)
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    top = int(tokens.max()) if tokens.size else -1
    if top >= tokenizer.vocab_size or (tokens.size and int(tokens.min()) < 0):
        raise DataError(f"shard {k}: the tokenizer gave id {top}, outside its vocabulary of {tokenizer.vocab_size}")
    data = tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(OFFSET_DTYPE).tobytes()
    names = shard_names(k)
    for name, payload in zip(names, (data, offsets)):
        with open(os.path.join(directory, name), "wb") as f:
            f.write(payload)
    return ShardEntry(names[0], names[1], int(tokens.size), len(docs), top, zlib.crc32(data), zlib.crc32(offsets))


def prepare(files: list[str], tokenizer_spec: str, output: str, shard_bytes: int = 64 << 20, jobs: int | None = None,
            split: str = "file", text_key: str = "text", progress: bool | None = None) -> DatasetIndex:
    """Write the token dataset of `files` to directory `output` and return its index (module docstring).

    `jobs`: threads writing shards (default: the CPUs); `progress`: a bar on stderr (None: where
    stderr is a terminal)."""
    from tqdm import tqdm

    if not files:
        raise DataError("no input files")
    for path in files:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file")
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise DataError(f"{output}: exists and is not an empty directory (choose another -o, or remove it)")
    if shard_bytes < 1:
        raise DataError(f"a shard of {shard_bytes} bytes of text: at least 1")

    def texts():
        return (doc for doc, _ in read_documents(files, split, text_key))

    tokenizer = make_tokenizer(tokenizer_spec, texts)
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = output.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    total = sum(os.path.getsize(p) for p in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr,
               disable=(not sys.stderr.isatty()) if progress is None else not progress)
    jobs = max(1, jobs or os.cpu_count() or 1)
    entries: list[ShardEntry] = []
    try:
        with ThreadPoolExecutor(jobs) as pool:
            pending: list = []
            for k, (docs, weight) in enumerate(_chunks(read_documents(files, split, text_key), shard_bytes)):
                pending.append((pool.submit(_write_shard, tmp, k, docs, tokenizer, dtype), weight))
                while len(pending) > 2 * jobs:  # bounded memory: finish the oldest before reading on
                    entries.append(_finish(pending.pop(0), bar))
            while pending:
                entries.append(_finish(pending.pop(0), bar))
        if not entries or not any(e.tokens for e in entries):
            raise DataError(f"{', '.join(files)}: no text to tokenize")
        saved = tokenizer.save(os.path.join(tmp, TOKENIZER))
        index = DatasetIndex(dtype, tokenizer.vocab_size, tokenizer.eod, tokenizer.name, tuple(entries),
                             TOKENIZER if saved else None)
        write_index(tmp, index)
        if os.path.isdir(output):
            os.rmdir(output)  # empty (checked above)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return index


def _finish(job, bar) -> ShardEntry:
    future, weight = job
    entry = future.result()
    bar.update(weight)
    return entry
