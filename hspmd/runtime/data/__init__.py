"""The runtime's side of data: feeding a rank's program its piece of each batch (`feed.py`), short
batches padded to the compiled batch (`batching.py`). Datasets, samplers and the on-disk format are
`hspmd.data` (`import hspmd as hs; hs.data`), which this package reads.

The names below were this module's before `hspmd.data` existed; model scripts that import them
from here keep working.
"""

from hspmd.data.text import (  # noqa: F401  (re-exported for scripts written against hspmd.runtime.data)
    DOC_MODULES,
    bucket_of,
    lm_epochs,
    lm_windows,
    pydoc_text_bytes,
    stdlib_documents,
    token_budget_batches,
)
