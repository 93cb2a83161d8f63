"""Repeated layers: `graph.scan` calls one layer function over stacked parameters, like `jax.lax.scan`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    DenseArrayBase,
    IntegerAttr,
    SymbolRefAttr,
    TensorType,
    UnitAttr,
)
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    opt_prop_def,
    prop_def,
    var_operand_def,
    var_result_def,
)
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import tensor_shape, tensor_type, i64_array, int_attr

__all__ = [
    "stacked_type",
    "ScanOp",
]


def _slice_type(typ: Attribute) -> TensorType:
    """Return tensor type `typ` without its leading dim (one iteration's piece of a stacked value)."""
    assert isinstance(typ, TensorType)
    return TensorType(typ.element_type, typ.get_shape()[1:], typ.encoding)


def stacked_type(typ: Attribute, length: int, encoding: Attribute | None = None) -> TensorType:
    """Return tensor type `typ` with a leading dim of `length` (`length` iterations' pieces stacked);
    `encoding` replaces the type's (a layout with the stacking dim), None keeps none."""
    assert isinstance(typ, TensorType)
    return tensor_type(typ.element_type, (length, *typ.get_shape()), encoding)


@irdl_op_definition
class ScanOp(IRDLOperation):
    """Call `@callee` `length` times in a row (a stack of repeated layers), like `jax.lax.scan`.

    Each argument j of the callee is fed, per iteration i, by operand j:
    * `stacked` j: the operand has a leading dim of `length`; iteration i gets its slice i
      (a stacked parameter `blocks.[0:48].attn.proj.weight`, a stacked residual);
    * `carry_args[k]` j: iteration 0 gets the operand, iteration i > 0 the result
      `carry_results[k]` of iteration i-1 (the residual stream of a transformer);
    * otherwise the operand itself, every iteration (an invariant).
    The results are the callee's: a carried result is its value after the last iteration; any
    other result is stacked, iteration i's value as slice i. With `reverse`, the iterations run
    from `length`-1 down to 0 (the backward of a forward scan), each still reading and writing
    its own slice i.

        %x, %res = graph.scan @Block_0_fwd(%w, %x0) {length = 48 : i64, stacked = array<i64: 0>,
            carry_args = array<i64: 1>, carry_results = array<i64: 0>}
            : (tensor<48x128x128xf32>, tensor<16x64x128xf32>) -> (tensor<16x64x128xf32>, tensor<48x...>)

    The program holds one copy of the layer however many layers there are: IR size and compile
    time do not grow with the layer count (`stack-layers` makes scans, `docs/levels.md`).
    """

    name = "graph.scan"
    NO_SHARDING_RULE: ClassVar[str] = "propagation lays out its callee's arguments and results"
    NO_VJP: ClassVar[str] = "autodiff differentiates its callee (transforms/scan_vjp.py)"
    NO_KERNEL: ClassVar[str] = "the schedule lays out its iterations (codegen/schedule/flatten.py)"
    NO_FRONTEND: ClassVar[str] = "made by stack-layers from repeated function modules"
    irdl_options = (ParsePropInAttrDict(),)
    args = var_operand_def(TensorType)
    outs = var_result_def(TensorType)
    callee = prop_def(SymbolRefAttr)
    length = prop_def(IntegerAttr[I64])
    stacked = prop_def(DenseArrayBase)
    carry_args = prop_def(DenseArrayBase)
    carry_results = prop_def(DenseArrayBase)
    reverse = opt_prop_def(UnitAttr)
    assembly_format = "$callee `(` $args `)` attr-dict `:` functional-type($args, $outs)"

    def __init__(self, callee: str, args: Sequence[SSAValue], result_types: Sequence[Attribute], *, length: int,
                 stacked: Sequence[int], carry_args: Sequence[int], carry_results: Sequence[int],
                 reverse: bool = False):
        props: dict[str, Attribute] = {
            "callee": SymbolRefAttr(callee), "length": int_attr(length), "stacked": i64_array(sorted(stacked)),
            "carry_args": i64_array(carry_args), "carry_results": i64_array(carry_results),
        }
        if reverse:
            props["reverse"] = UnitAttr()
        super().__init__(operands=[list(args)], result_types=[list(result_types)], properties=props)

    @property
    def num_iterations(self) -> int:
        """Return the number of iterations (`length`)."""
        return self.length.value.data

    @property
    def is_reverse(self) -> bool:
        """Return whether the iterations run from the last to the first."""
        return self.reverse is not None

    def stacked_args(self) -> tuple[int, ...]:
        """Return the indices of the stacked operands."""
        return tuple(self.stacked.get_values())  # type: ignore[arg-type]

    def carries(self) -> tuple[tuple[int, int], ...]:
        """Return (argument index, result index) of every carried value."""
        return tuple(zip(self.carry_args.get_values(), self.carry_results.get_values()))  # type: ignore[arg-type]

    def arg_kind(self, j: int) -> str:
        """Return how operand `j` feeds the callee: "stacked", "carry" or "invariant"."""
        if j in self.stacked_args():
            return "stacked"
        return "carry" if j in self.carry_args.get_values() else "invariant"

    def result_stacked(self, r: int) -> bool:
        """Return whether result `r` is stacked (not a carried value)."""
        return r not in self.carry_results.get_values()

    def callee_arg_types(self) -> list[TensorType]:
        """Return the type each callee argument gets per iteration (from the operands)."""
        stacked = self.stacked_args()
        return [_slice_type(v.type) if j in stacked else v.type for j, v in enumerate(self.args)]  # type: ignore

    def callee_result_types(self) -> list[TensorType]:
        """Return the type each callee result has per iteration (from the results)."""
        return [_slice_type(r.type) if self.result_stacked(k) else r.type for k, r in enumerate(self.outs)]  # type: ignore

    def verify_(self) -> None:
        n = self.num_iterations
        if n < 1:
            raise VerifyException(f"'{self.name}' needs length >= 1, has {n}")
        carry_args, carry_results = self.carry_args.get_values(), self.carry_results.get_values()
        if len(carry_args) != len(carry_results) or len(set(carry_args)) != len(carry_args) or len(
                set(carry_results)) != len(carry_results):
            raise VerifyException(f"'{self.name}' needs carry_args and carry_results of one length, each without repeats")
        stacked = self.stacked_args()
        if set(stacked) & set(carry_args):
            raise VerifyException(f"'{self.name}': an operand cannot be both stacked and carried")
        for j in (*stacked, *carry_args):
            if not 0 <= j < len(self.args):
                raise VerifyException(f"'{self.name}': operand index {j} out of range ({len(self.args)} operands)")
        for k in carry_results:
            if not 0 <= k < len(self.outs):
                raise VerifyException(f"'{self.name}': result index {k} out of range ({len(self.outs)} results)")
        for j in stacked:
            shape = tensor_shape(self.args[j])
            if not shape or shape[0] != n:
                raise VerifyException(f"'{self.name}': stacked operand {j} of type {self.args[j].type} needs a "
                                      f"leading dim of {n}")
        for k, r in enumerate(self.outs):
            shape = tensor_shape(r)
            if self.result_stacked(k) and (not shape or shape[0] != n):
                raise VerifyException(f"'{self.name}': stacked result {k} of type {r.type} needs a leading dim of {n}")
        for j, k in self.carries():
            a, b = self.args[j].type, self.outs[k].type
            if tensor_shape(a) != tensor_shape(b) or a.element_type != b.element_type:  # type: ignore[attr-defined]
                raise VerifyException(f"'{self.name}': carried operand {j} ({a}) and result {k} ({b}) differ")
        self._verify_callee()

    def _verify_callee(self) -> None:
        from xdsl.dialects import func
        from xdsl.dialects.builtin import ModuleOp

        module = self.parent_op()
        while module is not None and not isinstance(module, ModuleOp):
            module = module.parent_op()
        if module is None:
            return
        name = self.callee.root_reference.data
        fn = next((op for op in module.body.block.ops if isinstance(op, func.FuncOp) and op.sym_name.data == name),
                  None)
        if fn is None:
            raise VerifyException(f"'{self.name}': the module has no @{name}")

        def same(xs, ys) -> bool:  # shapes and element types (layouts differ by the stacking dim)
            return len(xs) == len(ys) and all(tensor_shape(x) == tensor_shape(y) and x.element_type == y.element_type
                                              for x, y in zip(xs, ys))

        if not same(self.callee_arg_types(), list(fn.function_type.inputs.data)):
            raise VerifyException(f"'{self.name}': its operands do not fit the arguments of @{name} "
                                  "(a stacked operand: the argument's type with a leading dim of the length)")
        if not same(self.callee_result_types(), list(fn.function_type.outputs.data)):
            raise VerifyException(f"'{self.name}': its results do not fit the results of @{name} "
                                  "(a stacked result: the callee's with a leading dim of the length)")
