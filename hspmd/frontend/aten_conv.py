"""ATen's convolution as hspmd ops, for 1-d inputs: the causal depthwise convolutions of
state-space and linear-attention layers (Mamba, Bamba, the gated delta nets) and any other
1-d convolution (groups, stride, dilation, padding), as sums over the kernel's taps of
shifted slices times the taps' weights (a product per tap where channels mix).

A 2-d or 3-d convolution (an image model) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable

from hspmd.dialects.graph.shape import concat, slice as take_slice
from hspmd.frontend.aten import Context, Unsupported, _matmul
from hspmd.frontend.aten_index import strided_slice


def convolution(cx: Context, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """`conv1d(x [B, Cin, T], w [Cout, Cin/groups, K])` (+ bias [Cout])."""
    x, w = cx.tensor(x), cx.tensor(w)
    if x.ndim != 3 or w.ndim != 3:
        raise Unsupported(f"a {x.ndim - 2}-d convolution (hspmd translates 1-d ones)")
    if transposed:
        raise Unsupported("a transposed convolution")
    (s,), (p,), (d,) = stride, padding, dilation
    b, cin, t = x.shape
    cout, per_group, k = w.shape
    if p:
        zeros = cx.tracer.constant(0.0, (b, cin, p), x.dtype)
        x = concat([zeros, x, zeros], 2)
    out_len = cx.shape[-1]
    total = None
    for tap in range(k):
        start = tap * d
        piece = strided_slice(cx, x, 2, start, start + (out_len - 1) * s + 1, s) if s != 1 else \
            take_slice(x, 2, start, start + out_len)  # [B, Cin, T_out]
        weight = take_slice(w, 2, tap, tap + 1).reshape((cout, per_group))  # [Cout, Cin/g]
        if groups == cin and per_group == 1 and cout == cin:  # depthwise: a product per channel
            term = piece * weight.reshape((1, cout, 1)).broadcast_to(piece.shape)
        else:
            xs = piece.reshape((b, groups, cin // groups, out_len))
            ws = weight.reshape((groups, cout // groups, per_group))
            term = _matmul(ws.reshape((1, groups, cout // groups, per_group)), xs).reshape((b, cout, out_len))
        total = term if total is None else total + term
    if bias is not None:
        total = total + cx.tensor(bias).reshape((1, cout, 1)).broadcast_to(total.shape)
    return total


#: ATen op name -> translator
TRANSLATORS: dict[str, Callable] = {"aten.convolution.default": convolution}

