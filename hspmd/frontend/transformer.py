"""Transformer language models written as for one device: GPT and a LLaMA-style variant.

Both are built from a config (`GPTConfig`) and name their parameters after the module tree
(`blocks.3.attn.qkv.weight`), so strategies and checkpoints can refer to them. A block is a
function module (`function = True`): traced once, called per layer, so the IR of a 48-layer
model is the IR of a 2-layer one plus calls.

    GPT:    token + position embeddings; pre-LayerNorm blocks of causal self-attention and a
            GELU (tanh) MLP; a final LayerNorm and a linear head.
    LLaMA:  token embeddings; pre-RMSNorm blocks of causal self-attention with rotary
            position embeddings (no biases) and a SwiGLU MLP; a final RMSNorm and a head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from hspmd.frontend import ops
from hspmd.frontend.nn import Embedding, LayerNorm, Linear, MoE, Module, Parameter, RMSNorm
from hspmd.frontend.tracing import Tensor


@dataclass
class GPTConfig:
    """Sizes of a GPT/LLaMA model; `d_ff` defaults to 4*d_model (GPT) or 8/3*d_model rounded (LLaMA)."""

    vocab_size: int = 256
    seq_len: int = 64
    layers: int = 2
    heads: int = 4
    d_model: int = 128
    d_ff: int | None = None
    dropout: float = 0.0
    init_std: float = 0.02
    eps: float = 1e-5
    rope_base: float = 10000.0
    #: attention stays within documents where the batch says which position is in which
    #: (`segments` [B, T], as `hs.data`'s packed windows give them; `lm_loss` passes them)
    document_mask: bool = False
    extra: dict = field(default_factory=dict)

    @staticmethod
    def from_dict(values: dict) -> GPTConfig:
        """Return the config with the known keys of `values` (others are kept in `extra`)."""
        names = {f.name for f in fields(GPTConfig)}
        known = {k: v for k, v in values.items() if k in names and k != "extra"}
        return GPTConfig(**known, extra={k: v for k, v in values.items() if k not in names})

    def check(self) -> None:
        """Raise ValueError naming the setting when the sizes do not fit together."""
        if self.d_model % self.heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.heads={self.heads}")
        if (self.d_model // self.heads) % 2:
            raise ValueError(f"the head size {self.d_model // self.heads} must be even (rotary embeddings)")
        for name in ("vocab_size", "seq_len", "layers", "heads", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be at least 1, got {getattr(self, name)}")


class CausalSelfAttention(Module):
    """Multi-head causal self-attention on [B, T, D]; rotary positions if `rotary`.

    GPT's fused `qkv` weight [D, 3D] is laid out head-major, as Megatron interleaves it: its
    output [B, T, 3D] is reshaped to [B, T, H, 3*hd] and cut into q, k, v along the last dim,
    so a column split of the 3D outputs into tp contiguous chunks is a split of the heads
    (each tp rank computes the attention of its H/tp heads; no gather of qkv).
    """

    def __init__(self, cfg: GPTConfig, rotary: bool = False) -> None:
        std, d = cfg.init_std, cfg.d_model
        self.heads = cfg.heads
        self.rotary = rotary
        self.rope_base = cfg.rope_base
        self.dropout = cfg.dropout
        proj_std = f"normal:{std / math.sqrt(2 * cfg.layers)!r}"
        if rotary:  # LLaMA: separate projections, no biases
            self.wq = Linear(d, d, bias=False, init=f"normal:{std!r}")
            self.wk = Linear(d, d, bias=False, init=f"normal:{std!r}")
            self.wv = Linear(d, d, bias=False, init=f"normal:{std!r}")
            self.proj = Linear(d, d, bias=False, init=proj_std)
        else:
            self.qkv = Linear(d, 3 * d, init=f"normal:{std!r}")
            self.proj = Linear(d, d, init=proj_std)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """`bias` [B, 1, T, T] (optional) is added to the attention scores before the causal mask."""
        b, t, d = x.shape
        h = self.heads
        hd = d // h
        if self.rotary:
            q, k, v = (z.reshape((b, t, h, hd)) for z in (self.wq(x), self.wk(x), self.wv(x)))
        else:  # head-major fused qkv: output column h*3*hd + c*hd + i is (q, k, v)[c] of head h, dim i
            q, k, v = ops.split(self.qkv(x).reshape((b, t, h, 3 * hd)), [hd, hd, hd], 3)
        if self.rotary:
            q, k = ops.rope(q, self.rope_base), ops.rope(k, self.rope_base)
        q, k, v = (z.transpose((0, 2, 1, 3)) for z in (q, k, v))  # [B, H, T, hd]
        scores = (q @ k.transpose((0, 1, 3, 2))) * (1.0 / math.sqrt(hd))
        if bias is not None:
            scores = scores + (bias if bias.dtype == scores.dtype else ops.cast(bias, scores.dtype))
        att = ops.softmax(ops.causal_mask(scores), -1)
        if self.dropout:
            att = ops.dropout(att, self.dropout)
        y = (att @ v).transpose((0, 2, 1, 3)).reshape((b, t, d))
        y = self.proj(y)
        return ops.dropout(y, self.dropout) if self.dropout else y


class MLP(Module):
    """GELU (tanh) MLP `proj(gelu(fc(x)))`, or SwiGLU `w2(silu(w1 x) * w3 x)` if `swiglu`."""

    def __init__(self, cfg: GPTConfig, swiglu: bool = False) -> None:
        std, d = cfg.init_std, cfg.d_model
        proj_std = f"normal:{std / math.sqrt(2 * cfg.layers)!r}"
        self.swiglu = swiglu
        self.dropout = cfg.dropout
        if swiglu:
            hidden = cfg.d_ff or 4 * ((int(8 * d / 3) + 3) // 4)
            self.w1 = Linear(d, hidden, bias=False, init=f"normal:{std!r}")
            self.w3 = Linear(d, hidden, bias=False, init=f"normal:{std!r}")
            self.w2 = Linear(hidden, d, bias=False, init=proj_std)
        else:
            hidden = cfg.d_ff or 4 * d
            self.fc = Linear(d, hidden, init=f"normal:{std!r}")
            self.proj = Linear(hidden, d, init=proj_std)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            y = self.w2(ops.silu(self.w1(x)) * self.w3(x))
        else:
            y = self.proj(ops.gelu(self.fc(x), approximate="tanh"))
        return ops.dropout(y, self.dropout) if self.dropout else y


class Block(Module):
    """A pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    function = True

    def __init__(self, cfg: GPTConfig, llama: bool = False) -> None:
        norm = (lambda: RMSNorm(cfg.d_model, cfg.eps)) if llama else (lambda: LayerNorm(cfg.d_model, cfg.eps))
        self.ln1 = norm()
        self.attn = CausalSelfAttention(cfg, rotary=llama)
        self.ln2 = norm()
        self.mlp = MLP(cfg, swiglu=llama)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        x = x + (self.attn(self.ln1(x)) if bias is None else self.attn(self.ln1(x), bias))
        return x + self.mlp(self.ln2(x))


#: the score added where a query and a key lie in different documents: exp(-6321) is 0 after softmax
_OTHER_DOCUMENT = -1.0e4


def document_bias(segments: Tensor) -> Tensor:
    """Return [B, 1, T, T]: 0 where query t and key s lie in one document (`segments` [B, T], float,
    equal), at most -6321 elsewhere (10^4 * (exp(-d^2) - 1) for segment numbers d apart: exactly 0
    for d = 0, and a weight of 0 after softmax for any other integer d)."""
    b, t = segments.shape
    d = segments.reshape((b, 1, t, 1)) - segments.reshape((b, 1, 1, t))
    return (ops.exp(d * d * -1.0) - 1.0) * -_OTHER_DOCUMENT


class GPT(Module):
    """A GPT language model: ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: GPTConfig) -> None:
        cfg.check()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.d_model, f"normal:{cfg.init_std!r}")
        self.wpe = Parameter((cfg.seq_len, cfg.d_model), f"normal:{cfg.init_std!r}")
        self.blocks = [Block(cfg) for _ in range(cfg.layers)]
        self.ln_f = LayerNorm(cfg.d_model, cfg.eps)
        self.head = Linear(cfg.d_model, cfg.vocab_size, bias=False, init=f"normal:{cfg.init_std!r}")

    def forward(self, ids: Tensor, segments: Tensor | None = None) -> Tensor:
        """`segments` [B, T] (with `document_mask`): attention stays within each document."""
        t = ids.shape[1]
        pos = self.wpe.traced("wpe") if t == self.cfg.seq_len else ops.slice(self.wpe.traced("wpe"), 0, 0, t)
        x = self.wte(ids) + pos
        if self.cfg.dropout:
            x = ops.dropout(x, self.cfg.dropout)
        bias = document_bias(segments) if segments is not None and self.cfg.document_mask else None
        for block in self.blocks:
            x = block(x) if bias is None else block(x, bias)
        return self.head(self.ln_f(x))


class LLaMA(Module):
    """A LLaMA-style language model: RMSNorm, rotary attention, SwiGLU; ids [B, T] -> logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        cfg.check()
        self.cfg = cfg
        self.tok = Embedding(cfg.vocab_size, cfg.d_model, f"normal:{cfg.init_std!r}")
        self.blocks = [Block(cfg, llama=True) for _ in range(cfg.layers)]
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.head = Linear(cfg.d_model, cfg.vocab_size, bias=False, init=f"normal:{cfg.init_std!r}")

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class MoEBlock(Module):
    """A pre-norm block whose MLP is a mixture of experts (`nn.MoE`); returns (x, aux loss)."""

    function = True

    def __init__(self, cfg: GPTConfig, experts: int, top_k: int, capacity_factor: float) -> None:
        self.ln1 = LayerNorm(cfg.d_model, cfg.eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = LayerNorm(cfg.d_model, cfg.eps)
        self.moe = MoE(cfg.d_model, cfg.d_ff or 4 * cfg.d_model, experts, top_k, capacity_factor, cfg.init_std,
                       cfg.init_std / math.sqrt(2 * cfg.layers))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.attn(self.ln1(x))
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class MoEGPT(GPT):
    """GPT whose every other block (the 2nd, 4th, ...) has a mixture-of-experts MLP (GShard's
    layout); ids [B, T] -> (logits, the sum of the MoE layers' load-balancing losses).

    `cfg.extra` gives `experts` (default 4), `top_k` (1), `capacity_factor` (1.0) and `aux_loss`,
    the weight of the load-balancing loss in `moe_lm_loss` (0.01)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        experts = int(cfg.extra.get("experts", 4))
        top_k = int(cfg.extra.get("top_k", 1))
        factor = float(cfg.extra.get("capacity_factor", 1.0))
        self.aux_weight = float(cfg.extra.get("aux_loss", 0.01))
        self.blocks = [MoEBlock(cfg, experts, top_k, factor) if i % 2 else Block(cfg) for i in range(cfg.layers)]

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        t = ids.shape[1]
        pos = self.wpe.traced("wpe") if t == self.cfg.seq_len else ops.slice(self.wpe.traced("wpe"), 0, 0, t)
        x = self.wte(ids) + pos
        aux = None
        for block in self.blocks:
            if isinstance(block, MoEBlock):
                x, a = block(x)
                aux = a if aux is None else aux + a
            else:
                x = block(x)
        return self.head(self.ln_f(x)), aux


def moe_lm_loss(model: MoEGPT, batch: dict) -> Tensor:
    """Return the next-token cross-entropy of an `MoEGPT` plus `model.aux_weight` times its load-balancing loss."""
    logits, aux = model(batch["ids"])
    loss = ops.cross_entropy(logits, batch["targets"])
    if aux is None or not model.aux_weight:
        return loss
    if aux.dtype != loss.dtype:  # mixed precision: the loss is float32, the layers compute in 16 bits
        aux = ops.cast(aux, loss.dtype)
    return loss + aux * model.aux_weight


def lm_loss(model: Module, batch: dict, ignore_index: int = -100) -> Tensor:
    """Return the next-token cross-entropy of `model` on `batch["ids"]` against `batch["targets"]`
    A batch with `segments` (`hs.data`'s packed windows) has targets equal to `ignore_index` that
    count for nothing, and a model with `document_mask` gets the segments, so that its attention
    stays within documents."""
    if "segments" not in batch:
        return ops.cross_entropy(model(batch["ids"]), batch["targets"])
    if getattr(getattr(model, "cfg", None), "document_mask", False):
        return ops.cross_entropy(model(batch["ids"], batch["segments"]), batch["targets"], ignore_index=ignore_index)
    return ops.cross_entropy(model(batch["ids"]), batch["targets"], ignore_index=ignore_index)
