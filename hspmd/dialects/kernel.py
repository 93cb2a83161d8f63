"""The `kernel` dialect: fused kernels whose CUDA C source is part of the IR.

`kernel.fused` stands for a group of `graph`/`optim` ops that the `fuse-kernels` pass
merged into one generated kernel (or a short sequence of launches sharing one source):

    %y, %g = "kernel.fused"(%x, %b) <{kernel = "fused_3_add_gelu", dtype = "f32",
        launches = ["elementwise fused_3_add_gelu 2048 0"], scratch = array<i64>,
        source = "HS_KERNEL void fused_3_add_gelu(...) {...}"}> ({
      ^0(%a: tensor<..>, %c: tensor<..>):
        ... the original ops ...
        "kernel.yield"(%s, %t) : (...) -> ()
    }) : (...) -> (...)

* `source` holds CUDA C written against a tiny portability layer (`HS_KERNEL`, `HS_FOR`,
  `hs_block_sum`, ...) that `hspmd/codegen/cuda_preamble.cuh` defines for NVRTC/CuPy and
  `hspmd/codegen/cuda_emu.h` defines for the host C++ compiler, so one text runs on both.
* `launches` lists the `__global__` functions to run in order, each as
  `"KIND NAME N0 N1"`: KIND `elementwise` runs NAME over `N0` elements (grid-stride loop on a
  GPU, an OpenMP `for` on the CPU); KIND `row` runs it with one block per row, `N0` rows of
  `N1` columns (a block reduction per row).
* Every launch takes the same arguments: the operands, the results, then `scratch` buffers
  (element counts, in the kernel's float type), then `long n0, long n1`.
* `pieces` (optional) marks a multi-tensor kernel (`multi-tensor`): several elementwise kernels
  of one source side by side in one `row` launch, a block per chunk of a piece's items.
* The body region keeps the ops the kernel replaced: it is the reference semantics, and the
  NumPy fallback runs it op by op where no compiler or GPU is there.
"""

from __future__ import annotations

from typing import ClassVar

from xdsl.dialects.builtin import ArrayAttr, DenseArrayBase, StringAttr, TensorType
from xdsl.ir import Attribute, Block, Dialect, Region, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    irdl_op_definition,
    opt_prop_def,
    prop_def,
    region_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.traits import IsTerminator, Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import parse_rank_values, rank_prelude
from hspmd.dialects.graph.base import i64_array
from hspmd.dialects.interfaces import FIRST, OUT, OutFacts

__all__ = ["Kernel", "FusedOp", "YieldOp", "LAUNCH_KINDS", "DTYPES"]

#: what a launch can be: elementwise over N0 items, or one block per row of N0 x N1
LAUNCH_KINDS = ("elementwise", "row")
#: float types a generated kernel computes in, by the IR's spelling
DTYPES = ("f32", "f64", "bf16", "f16")


def parse_launch(text: str) -> tuple[str, str, int, int]:
    """Return (kind, function name, n0, n1) of a launch string `"KIND NAME N0 N1"`."""
    parts = text.split()
    if len(parts) != 4 or parts[0] not in LAUNCH_KINDS or not parts[1].isidentifier():
        raise VerifyException(f"'kernel.fused': launch '{text}' is not 'KIND NAME N0 N1' with KIND in {LAUNCH_KINDS}")
    try:
        n0, n1 = int(parts[2]), int(parts[3])
    except ValueError:
        raise VerifyException(f"'kernel.fused': launch '{text}' has non-integer extents") from None
    if n0 < 0 or n1 < 0 or (parts[0] == "row" and n1 < 1):
        raise VerifyException(f"'kernel.fused': launch '{text}' has bad extents")
    return parts[0], parts[1], n0, n1


@irdl_op_definition
class YieldOp(IRDLOperation):
    """Ends a `kernel.fused` body: the values that become the fused op's results."""

    name = "kernel.yield"
    NO_SHARDING_RULE: ClassVar[str] = "a terminator of a physical-level kernel"
    NO_VJP: ClassVar[str] = "a terminator of a physical-level kernel"
    NO_KERNEL: ClassVar[str] = "ends a kernel.fused body"
    NO_FRONTEND: ClassVar[str] = "made by fuse-kernels"
    values = var_operand_def()
    traits = traits_def(IsTerminator())

    def __init__(self, *values: SSAValue):
        super().__init__(operands=[list(values)])


@irdl_op_definition
class FusedOp(IRDLOperation):
    """A generated kernel (see the module docstring): operands in, results out, body = semantics."""

    name = "kernel.fused"
    NO_SHARDING_RULE: ClassVar[str] = "made at the kernel level, after layouts are decided"
    NO_VJP: ClassVar[str] = "made at the kernel level, after autodiff"
    NO_KERNEL: ClassVar[str] = "its compiled CUDA C runs it (runtime/kernel_exec.py); its body is the per-op reference"
    NO_FRONTEND: ClassVar[str] = "made by fuse-kernels"
    inputs = var_operand_def(TensorType)
    outputs = var_result_def(TensorType)
    kernel = prop_def(StringAttr)
    dtype = prop_def(StringAttr)
    source = prop_def(StringAttr)
    launches = prop_def(ArrayAttr[StringAttr])
    scratch = prop_def(DenseArrayBase)
    #: a kernel reading its piece's global position: the values of its macros per rank
    #: (`cuda_c.format_rank_values`), defined before the source when a rank builds it
    rank_values = opt_prop_def(StringAttr)
    #: a multi-tensor kernel (`transforms/multi_tensor.py`): the item counts of the elementwise
    #: kernels it runs side by side, one launch for all (item i of a piece depends only on item
    #: i of that piece's operands)
    pieces = opt_prop_def(DenseArrayBase)
    body = region_def("single_block")
    traits = traits_def(Pure())

    def __init__(
        self,
        inputs: list[SSAValue],
        result_types: list[Attribute],
        kernel: str,
        dtype: str,
        source: str,
        launches: list[str],
        scratch: list[int],
        body: Region,
        rank_values: str = "",
        pieces: list[int] | None = None,
    ):
        properties = {
            "kernel": StringAttr(kernel),
            "dtype": StringAttr(dtype),
            "source": StringAttr(source),
            "launches": ArrayAttr([StringAttr(s) for s in launches]),
            "scratch": i64_array(scratch),
        }
        if rank_values:
            properties["rank_values"] = StringAttr(rank_values)
        if pieces is not None:
            properties["pieces"] = i64_array(pieces)
        super().__init__(operands=[inputs], result_types=[result_types], properties=properties, regions=[body])

    def source_for(self, rank: int) -> str:
        """Return the kernel's source as `rank` builds it: its rank values defined first (where
        the kernel reads its piece's global position and the rank holds one)."""
        if self.rank_values is None:
            return self.source.data
        values = parse_rank_values(self.rank_values.data).get(rank)
        return self.source.data if values is None else rank_prelude(self.kernel.data, values) + self.source.data

    def out_facts(self) -> OutFacts:
        """Compiled launches over pointers write out= buffers; a chain of elementwise ops (its
        body's ops compute item i from the operands' items i, or read through a broadcast) reads
        each item before it writes it, so its result may be its first operand's array."""
        pointwise = all(callable(getattr(op, "cuda_expr", None)) or callable(getattr(op, "cuda_read_index", None))
                        for op in self.body.block.ops if not isinstance(op, YieldOp))
        elementwise = (self.pieces is not None or all(kind == "elementwise" for kind, _, _, _ in self.launch_list)) \
            and not self.scratch_sizes
        return FIRST if elementwise and pointwise else OUT

    @property
    def launch_list(self) -> list[tuple[str, str, int, int]]:
        """Return the launches as (kind, name, n0, n1)."""
        return [parse_launch(s.data) for s in self.launches.data]

    @property
    def scratch_sizes(self) -> tuple[int, ...]:
        """Return the element counts of the scratch buffers."""
        return tuple(self.scratch.get_values())  # type: ignore[arg-type]

    def verify_(self) -> None:
        if not self.kernel.data.isidentifier():
            raise VerifyException(f"'{self.name}': kernel name '{self.kernel.data}' is not an identifier")
        if self.dtype.data not in DTYPES:
            raise VerifyException(f"'{self.name}': dtype must be one of {DTYPES}, got '{self.dtype.data}'")
        launches = self.launch_list
        if not launches:
            raise VerifyException(f"'{self.name}' @{self.kernel.data} has no launch")
        for _, fname, _, _ in launches:
            if f" {fname}(" not in self.source.data:
                raise VerifyException(f"'{self.name}': the source defines no function '{fname}' of launch '{fname}'")
        if any(n < 0 for n in self.scratch_sizes):
            raise VerifyException(f"'{self.name}': scratch sizes must be >= 0")
        block = self.body.block
        if [a.type for a in block.args] != [v.type for v in self.inputs]:
            raise VerifyException(f"'{self.name}': body arguments must have the operands' types")
        last = block.last_op
        if not isinstance(last, YieldOp):
            raise VerifyException(f"'{self.name}': body must end with kernel.yield")
        if [v.type for v in last.values] != [r.type for r in self.outputs]:
            raise VerifyException(f"'{self.name}': kernel.yield must yield the results' types")


def make_body(arg_types: list[Attribute]) -> tuple[Region, Block]:
    """Return an empty single-block region with arguments of `arg_types`, and its block."""
    block = Block(arg_types=arg_types)
    return Region(block), block


Kernel = Dialect("kernel", [FusedOp, YieldOp], [])
