"""`hs.data`: datasets, a sampler that does not depend on the strategy, and a loader that resumes.

    import hspmd as hs

    def dataset(config):                          # a model script's data, instead of batches(config)
        corpus = hs.data.TokenDataset(config["data"]["path"])       # hspmd data prepare ... -o DIR
        return corpus.windows(config["model"]["seq_len"] + 1)       # rows "ids", "targets"

Datasets (anything with `len(ds)` and `ds.read(indices)` -> a dict of arrays, one row per index):
`TokenDataset` (a prepared directory of token shards, `format.py`), `tokens` (token ids in
memory), their views `windows`, `documents`, `packed`; `ArrayDataset` (rows of arrays in
memory); `from_hf` (a Hugging Face `datasets` table). `Sampler` orders the samples of every
epoch by a keyed permutation of (seed, epoch): global batch k is the same under any strategy and
device count, and the position is two integers. `Loader` reads a sampler's batches, only some
rows of each where a rank needs only those (`rows.py`), ahead of time in a thread, with its
position as a `state_dict` a checkpoint stores. docs/data.md has the whole story.

This package imports nothing of hspmd's (it is the bottom of the package picture beside `ir`),
so the tracing API, the compiler and the runtime all read it.
"""

from hspmd.data.arrays import ArrayDataset, HFDataset, from_hf
from hspmd.data.corpus import MemoryTokens, TokenCorpus, TokenDataset, tokens
from hspmd.data.errors import DataError
from hspmd.data.loader import Loader
from hspmd.data.rows import RowPlan, row_plan
from hspmd.data.sampler import Sampler
from hspmd.data.views import IGNORE_INDEX, Documents, Packed, Windows

__all__ = [
    "ArrayDataset", "DataError", "Documents", "HFDataset", "IGNORE_INDEX", "Loader", "MemoryTokens", "Packed",
    "RowPlan", "Sampler", "TokenCorpus", "TokenDataset", "Windows", "from_hf", "row_plan", "tokens", "vocab_size",
]


def vocab_size(path: str) -> int:
    """Return the vocabulary of the prepared dataset at `path` (its index's; reads nothing else)."""
    from hspmd.data.format import read_index

    return read_index(path).vocab_size
