"""Every ATen op the PyTorch importer translates, and how: one table from the translator modules.

`aten.py` (linear algebra, views, norms, attention, the loss), `aten_math.py` (elementwise
functions, comparisons, logic) and `aten_index.py` (indexing with tensors, gather and scatter,
top-k, cumulative sums, strided slices), `aten_conv.py` (1-d convolutions) each hold a table of their own, and `torch_experts.py`
the operators transformers' expert layers are exported with (`torch.ops.hspmd.*`); a later table's entry
replaces an earlier one's (`aten_index` gives `slice.Tensor` its steps).
"""

from __future__ import annotations

from collections.abc import Callable

from hspmd.frontend import aten, aten_conv, aten_index, aten_math, torch_experts

TRANSLATORS: dict[str, Callable] = {**aten.TRANSLATORS, **aten_math.TRANSLATORS, **aten_index.TRANSLATORS,
                                   **aten_conv.TRANSLATORS, **torch_experts.TRANSLATORS}
IDENTITY = aten.IDENTITY
ASSERTS = aten.ASSERTS
