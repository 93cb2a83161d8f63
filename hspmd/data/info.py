"""`hspmd data info DIR`: what a prepared token dataset holds, and a check of every shard."""

from __future__ import annotations

import os

from hspmd.data.corpus import TokenDataset
from hspmd.data.tokenizer import tokenizer_summary

__all__ = ["dataset_info"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def dataset_info(path: str, verify: bool = True) -> str:
    """Return the report of the dataset at `path`: documents, tokens, shards, vocabulary, tokenizer,
    each shard's counts and checksums, and (with `verify`) that every checksum holds. DataError (one
    line, naming the shard) for a dataset that is malformed, truncated or corrupt."""
    ds = TokenDataset(path)
    index = ds.index
    if verify:
        ds.verify()
    nbytes = sum(os.path.getsize(os.path.join(ds.path, s.file)) for s in index.shards)
    lines = [
        f"dataset: {ds.path}",
        f"documents: {index.documents}",
        f"tokens: {index.tokens} ({index.dtype}, {_size(nbytes)})",
        f"shards: {len(index.shards)}",
        f"vocabulary: {index.vocab_size}" + (f" (end of document: {index.eod})" if index.eod is not None else ""),
        f"tokenizer: {tokenizer_summary(index, ds.path)}",
        "",
        f"{'shard':<18}{'documents':>10}{'tokens':>14}{'max id':>8}  {'crc32':<9} {'index crc32':<11}",
    ]
    for s in index.shards:
        lines.append(f"{s.file:<18}{s.documents:>10}{s.tokens:>14}{s.max_id:>8}  {s.crc32:08x}  {s.index_crc32:08x}")
    lines.append("")
    lines.append(f"checksums: {'ok, every shard read back' if verify else 'not checked (--no-verify)'}")
    ds.close()
    return "\n".join(lines) + "\n"
