"""Every op says what it is: the facts its level needs stand on its class (`dialects/interfaces.py`).

`op_facts_table()` lists every op of every dialect with the facts it has (`python
tests/test_op_facts.py` prints it); the tests fail where an op lacks one its level needs, so a
missing piece is found here and not when a model first uses the op:

* a sharding rule (`sharding_rule`), or why it needs none (`NO_SHARDING_RULE`);
* a gradient (`vjp`), or why it has none (`NO_VJP`: a gradient op, an optimizer update, ...);
* a NumPy kernel (`numpy_kernel`), or what runs it instead (`NO_KERNEL`: the plan, a communicator);
* a frontend (`FRONTEND`, names that resolve and that `hspmd` exports) for every op a user
  writes, or why it has none (`NO_FRONTEND`: made by a pass);
* a CUDA kernel (`cuda_expr`, `cuda_row`) where one exists; `CUDA_REQUIRED` turns this into a
  requirement for every op with a NumPy kernel once the GPU runtime runs whole steps;
* the ATen ops the PyTorch importer translates into it (`ATEN`), where there are any: each
  ATen op answers to one op, and the importer has a translator for each
  (`tests/test_torch_import.py` checks the translators against the facts).

The facts are then checked on the ops of real programs: every rule names a factor per dim of
every operand and result, every kernel can be made, and what a kernel's markers say of `out=`
matches its op's `OUT_FACTS`.
"""

from __future__ import annotations

import os

import pytest
from xdsl.dialects import func

import hspmd as hs
from hspmd.dialects.context import hspmd_dialects
from hspmd.dialects.interfaces import (
    HasCudaExpr,
    HasCudaRow,
    HasNumpyKernel,
    HasShardingRule,
    KernelContext,
    aten_names,
    frontend_names,
    has_vjp,
    no_vjp_reason,
    out_facts_of,
)
from hspmd.frontend import ops as frontend_ops
from hspmd.frontend.tracing import Tensor, Tracer

#: every op with a NumPy kernel must have a GPU kernel too: a fusable expression, a row template,
#: a standalone kernel, a GEMM or a view (`transforms/device_kernels.py`)
CUDA_REQUIRED = True

ALL_OPS = [op for dialect in hspmd_dialects() for op in dialect.operations]


def _facts(op: type) -> dict[str, str]:
    """Return, per fact, "yes", the op's reason for not having it, or "" (missing)."""
    cuda = ("expr" if issubclass(op, HasCudaExpr) else "row" if issubclass(op, HasCudaRow)
            else "kernel" if callable(getattr(op, "cuda_kernel", None)) else "gemm" if getattr(op, "CUDA_GEMM", False)
            else "view" if getattr(op, "DEVICE_VIEW", False) else "")
    return {
        "sharding": "yes" if issubclass(op, HasShardingRule) else getattr(op, "NO_SHARDING_RULE", ""),
        "vjp": "yes" if has_vjp(op) else no_vjp_reason(op) or "",
        "numpy": "yes" if issubclass(op, HasNumpyKernel) else getattr(op, "NO_KERNEL", ""),
        "out=": repr(getattr(op, "OUT_FACTS", "")) if hasattr(op, "OUT_FACTS") else
                "by attributes" if callable(getattr(op, "out_facts", None)) else "",
        "cuda": cuda,
        "frontend": ", ".join(frontend_names(op)) or getattr(op, "NO_FRONTEND", ""),
        "aten": ", ".join(n.removeprefix("aten.") for n in aten_names(op)),
    }


def op_facts_table() -> str:
    """Return a table of every op and its facts ("-" where it has none)."""
    rows = [(op.name, {k: ("yes" if v == "yes" else "-" if not v else v if k in ("cuda", "frontend", "out=", "aten")
                           else "n/a") for k, v in _facts(op).items()}) for op in ALL_OPS]
    keys = list(rows[0][1])
    widths = [max(len(r[0]) for r in rows), *(max(len(k), *(len(r[1][k]) for r in rows)) for k in keys)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(["op", *keys]), *(line([name, *(f[k] for k in keys)]) for name, f in rows)])


def test_every_op_has_the_facts_its_level_needs():
    missing = []
    for op in ALL_OPS:
        facts = _facts(op)
        for fact in ("sharding", "vjp", "numpy"):
            if not facts[fact]:
                missing.append(f"{op.name}: no {fact} (give it one, or a reason: see dialects/interfaces.py)")
        if has_vjp(op) and not facts["frontend"]:
            missing.append(f"{op.name}: differentiable but no FRONTEND function (or NO_FRONTEND reason)")
        if CUDA_REQUIRED and facts["numpy"] == "yes" and not facts["cuda"]:
            missing.append(f"{op.name}: a NumPy kernel but no CUDA kernel")
    assert not missing, "\n".join(missing) + "\n\n" + op_facts_table()


def test_all_ops_with_a_kernel_of_their_own_say_whether_it_writes_out_buffers_consistently():
    """`OUT_FACTS` (a class constant) and `out_facts()` (facts that depend on attributes) are
    the only two ways; an op has one or neither (then it writes fresh arrays)."""
    both = [op.name for op in ALL_OPS if hasattr(op, "OUT_FACTS") and callable(getattr(op, "out_facts", None))]
    assert not both, f"ops with both OUT_FACTS and out_facts(): {both}"


def test_every_frontend_name_resolves_and_is_exported():
    for op in ALL_OPS:
        for name in frontend_names(op):
            owner, _, attr = name.rpartition(".")
            if owner:
                assert owner in ("Tensor", "Tracer"), f"{op.name}: FRONTEND {name!r} names an unknown class"
                assert hasattr({"Tensor": Tensor, "Tracer": Tracer}[owner], attr), f"{op.name}: no {name}"
                continue
            assert callable(getattr(frontend_ops, name, None)), f"{op.name}: frontend.ops has no {name}()"
            assert getattr(hs, name, None) is getattr(frontend_ops, name), f"{op.name}: hspmd does not export {name}"


def test_every_aten_op_answers_to_one_op():
    """An ATen op of the importer's names one op (`ATEN`); ops beyond the graph dialect have none."""
    owners: dict[str, list[str]] = {}
    for op in ALL_OPS:
        for name in aten_names(op):
            assert name.startswith("aten.") and name.count(".") == 2, f"{op.name}: ATEN {name!r} is not an ATen overload"
            owners.setdefault(name, []).append(op.name)
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}
    assert all(op.name.startswith("graph.") for op in ALL_OPS if aten_names(op))
    assert {"aten.linear.default", "aten.scaled_dot_product_attention.default", "aten.layer_norm.default",
            "aten.embedding.default", "aten.cross_entropy_loss.default"} <= set(owners)


def test_the_dialects_list_every_op_once():
    names = [op.name for op in ALL_OPS]
    assert len(names) == len(set(names))


# ----------------------------------------------------------------------------- facts on real programs


def _every_function_step():
    """Return the logical step of a model that calls every frontend function (autodiff, AdamW
    with clipping), its physical program on one device, and its kernel level."""
    from hspmd.compiler import annotate, kernel_level, run_passes, to_physical

    t = Tracer()
    x = t.input("x", (4, 6), "float32")
    ids = t.input("ids", (4, 3), "int64")
    labels = t.input("labels", (4, 3), "int64")
    w = t.parameter("w", (6, 8), "normal:0.3")
    table = t.parameter("table", (11, 8), "normal:0.3")
    h = hs.matmul(x, w)  # [4, 8]
    acts = [hs.relu(h), hs.exp(h * 0.1), hs.log(hs.exp(h) + 1.0), hs.sqrt(h * h + 1.0), hs.rsqrt(h * h + 1.0),
            hs.tanh(h), hs.sigmoid(h), hs.silu(h), hs.gelu(h), hs.gelu(h, "tanh"), hs.power(h, 3)]
    h = acts[0]
    for a in acts[1:]:
        h = h + a
    h = hs.layer_norm(h) + hs.rms_norm(h)
    left, right = hs.split(h, [3, 5], 1)
    h = hs.concat([right, left], 1) + hs.divide(h, h * h + 2.0)
    h = hs.cast(hs.cast(h, "float64"), "float32")
    e = hs.embedding(table, ids)  # [4, 3, 8]
    q = hs.rope(e.reshape((4, 3, 2, 4)))
    s = hs.softmax(hs.causal_mask(q.reshape((4, 3, 8)) @ e.transpose([0, 2, 1])), -1)  # [4, 3, 3]
    y = hs.dropout(s @ e, 0.1) + h.reshape((4, 1, 8)).broadcast_to((4, 3, 8))
    loss = hs.cross_entropy(y, labels, ignore_index=7) + hs.max(y, 2).sum() * 0.01
    loss = loss + hs.binary_cross_entropy_with_logits(hs.slice(y, 2, 0, 1), hs.sigmoid(hs.slice(y, 2, 1, 2)))
    t.output("loss", loss)
    logical = t.finish()
    opt = hs.optim.AdamW(1e-3, clip_grad_norm=1.0)
    run_passes(logical, "autodiff," + opt.pipeline())
    physical = to_physical(annotate(logical.clone(), "[0]: dp=1"))
    return [logical, physical, *(m for _, m in kernel_level(physical))]


def _moe_and_vocabulary_programs():
    """Return the logical and physical programs of the MoE example under ep=2 and GPT under tp=2."""
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script

    examples = os.path.join(os.path.dirname(__file__), "..", "examples")
    out = []
    for script, strategy in (("moe.py", "[0,1]: ep=2"), ("gpt.py", "[0,1]: tp=2")):
        compiled = compile_script(load_script(os.path.join(examples, script), {}), strategy, 2)
        out += [compiled.logical, compiled.physical]
    return out


@pytest.fixture(scope="module")
def real_ops():
    seen: dict[type, list] = {}
    for module in (*_every_function_step(), *_moe_and_vocabulary_programs()):
        for op in module.walk():
            if not isinstance(op, (func.FuncOp, func.ReturnOp, func.CallOp)) and op.dialect_name() != "builtin":
                seen.setdefault(type(op), []).append(op)
    return seen


def test_the_programs_use_the_ops_of_the_examples(real_ops):
    """The programs below exercise every op the examples' models and optimizers make (an op with
    a test file of its own, such as `tests/test_op_erf.py`, checks its facts there)."""
    used = {op.name for op in real_ops}
    assert {"graph.layer_norm_grad", "graph.moe_route", "graph.one_hot", "graph.dropout", "graph.scan",
            "graph.expert_matmul_rhs_grad", "graph.rope_grad", "graph.reduce_max_grad", "optim.adam",
            "optim.clip_coef", "comm.all_to_all"} <= used


def check_facts(op) -> None:
    """Check what `op`'s facts say against the op itself: its rule names a factor per dim of
    every operand and result, its NumPy kernel can be made, and the kernel's `out=` markers say
    what the op's `OUT_FACTS` say."""
    from hspmd.runtime.plan import accepts_out, inplace_safe

    if isinstance(op, HasShardingRule):
        rule = op.sharding_rule()
        assert len(rule.operands) == len(op.operands) and len(rule.results) == len(op.results), op.name
        for factors, value in (*zip(rule.operands, op.operands), *zip(rule.results, op.results)):
            assert len(factors) == len(value.type.get_shape()), f"{op.name}: {factors} for {value.type}"
    if isinstance(op, HasNumpyKernel):
        kernel = op.numpy_kernel(KernelContext())
        assert callable(kernel), op.name
        facts = out_facts_of(op)
        assert accepts_out(kernel) == facts.takes_out, f"{op.name}: out= {accepts_out(kernel)} vs {facts}"
        if facts.overwrites == "first":
            assert inplace_safe(kernel), f"{op.name}: OUT_FACTS say out may be the first operand"


def test_op_facts_hold_on_real_ops(real_ops):
    for instances in real_ops.values():
        for op in instances[:3]:
            check_facts(op)


def test_cuda_kernels_listed():
    """Which ops a fused CUDA C kernel computes today (the GPU runtime adds the rest)."""
    with_cuda = {op.name for op in ALL_OPS if _facts(op)["cuda"]}
    assert {"graph.add", "graph.gelu", "graph.softmax", "graph.layer_norm", "optim.adam"} <= with_cuda


if __name__ == "__main__":
    print(op_facts_table())
