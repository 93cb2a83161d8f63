"""A model script whose model is described by data: `config["spec"]` (drawn by `tests/models.py`).

It is written as a user outside this repository would write a transformer with `hs.nn`, in the
several ways users do (not as `hspmd.frontend.transformer` does it): a decoder language model
(causal attention, a head on every token, tied or untied to the embedding) or an encoder with a
pooled classifier (first token or mean, attention causal or not); heads whose count tp may not
divide and head dims that need not multiply up to the model width; q/k/v as three weights, one
fused weight cut flat (`q, k, v = split(qkv(x), [a, a, a])`) or head-major as GPT does; GELU,
ReLU or gated (SwiGLU, GEGLU) MLPs of any width; LayerNorm or RMSNorm, before or after each
sublayer; learned, rotary or no positions; mixture-of-experts MLPs; dropout; 1-4 layers, as
function modules (traced once, stacked) or inline.

    spec = {"kind": "decoder", "layers": 2, "heads": 3, "head_dim": 4, ...}   (see SPEC_KEYS)

`hspmd run tests/generated_model.py --set 'spec={...}'` trains one; `tests/models.py` draws them.
"""

from __future__ import annotations

import math

import numpy as np

import hspmd as hs
from hspmd.frontend import ops

#: every key of a spec, with the default the script runs without `--set spec=...`
DEFAULT_SPEC = {
    "kind": "decoder",  # "decoder": a language model, a loss on every token; "encoder": a pooled classifier
    "causal": True,  # causal attention (a decoder is always causal)
    "vocab": 32, "seq": 8, "batch": 8,
    "d_model": 16, "heads": 2, "head_dim": 8,  # the attention width is heads * head_dim (need not be d_model)
    "qkv": "separate",  # "separate" (wq, wk, wv), "flat" (one weight, split flat) or "head-major" (GPT's)
    "bias": True,  # biases on the attention and MLP linears
    "rows": False,  # the MLP and the attention's output projection on [batch * seq, d] rows, as some users write
    "mlp": "gelu",  # "gelu", "relu", "swiglu" or "geglu"
    "d_ff": 32,
    "norm": "layer",  # "layer" or "rms"
    "prenorm": True,  # pre-norm blocks (x + f(norm(x))), else post-norm (norm(x + f(x)))
    "final_norm": True,
    "positions": "learned",  # "learned", "rope" or "none"
    "tied": False,  # a decoder's head is the embedding table, transposed
    "pool": "first",  # an encoder's classifier input: "first" token or "mean" over the sequence
    "classes": 3,
    "moe": [],  # indices of the layers whose MLP is a mixture of experts
    "experts": 2, "top_k": 1, "capacity": 1.0,
    "dropout": 0.0,
    "layers": 2,
    "function": True,  # blocks are function modules (traced once, stacked)
    "optimizer": "sgd",  # "sgd", "adam" or "adamw"
    "clip": 0.0,  # gradient-norm clipping (0: none)
}
SPEC_KEYS = tuple(DEFAULT_SPEC)

config = {"spec": dict(DEFAULT_SPEC), "steps": 3, "seed": 0, "microbatches": 1, "pipeline_schedule": "gpipe"}


def _spec(config: dict) -> dict:
    spec = {**DEFAULT_SPEC, **config["spec"]}
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"unknown spec keys {unknown}")
    return spec


def _norm(s: dict) -> hs.nn.Module:
    return hs.nn.LayerNorm(s["d_model"]) if s["norm"] == "layer" else hs.nn.RMSNorm(s["d_model"])


class Attention(hs.nn.Module):
    def __init__(self, s: dict) -> None:
        d, a = s["d_model"], s["heads"] * s["head_dim"]
        self.heads, self.head_dim, self.causal = s["heads"], s["head_dim"], s["causal"] or s["kind"] == "decoder"
        self.rope, self.dropout, self.layout = s["positions"] == "rope", s["dropout"], s["qkv"]
        if self.layout == "separate":
            self.wq, self.wk, self.wv = (hs.nn.Linear(d, a, bias=s["bias"]) for _ in range(3))
        else:
            self.wqkv = hs.nn.Linear(d, 3 * a, bias=s["bias"])
        self.wo = hs.nn.Linear(a, d, bias=s["bias"])
        self.rows = s["rows"]

    def forward(self, x):
        b, t, _ = x.shape
        h, hd = self.heads, self.head_dim
        if self.layout == "separate":
            q, k, v = (w(x).reshape((b, t, h, hd)) for w in (self.wq, self.wk, self.wv))
        elif self.layout == "flat":
            q, k, v = (z.reshape((b, t, h, hd)) for z in hs.split(self.wqkv(x), [h * hd] * 3, 2))
        else:  # head-major: columns h*3*hd + c*hd + i are (q, k, v)[c] of head h
            q, k, v = hs.split(self.wqkv(x).reshape((b, t, h, 3 * hd)), [hd, hd, hd], 3)
        if self.rope:
            q, k = hs.rope(q), hs.rope(k)
        q, k, v = (z.transpose((0, 2, 1, 3)) for z in (q, k, v))
        scores = (q @ k.transpose((0, 1, 3, 2))) * (1.0 / math.sqrt(hd))
        att = hs.softmax(hs.causal_mask(scores) if self.causal else scores, -1)
        if self.dropout:
            att = hs.dropout(att, self.dropout)
        if self.rows:  # [batch * seq, width] rows through the projection, then back
            return self.wo((att @ v).transpose((0, 2, 1, 3)).reshape((b * t, h * hd))).reshape((b, t, -1))
        return self.wo((att @ v).transpose((0, 2, 1, 3)).reshape((b, t, h * hd)))


class FeedForward(hs.nn.Module):
    def __init__(self, s: dict) -> None:
        d, f = s["d_model"], s["d_ff"]
        self.kind = s["mlp"]
        self.up = hs.nn.Linear(d, f, bias=s["bias"])
        if self.kind in ("swiglu", "geglu"):
            self.gate = hs.nn.Linear(d, f, bias=s["bias"])
        self.down = hs.nn.Linear(f, d, bias=s["bias"])
        self.rows = s["rows"]

    def forward(self, x):
        if self.rows:
            b, t, d = x.shape
            return self._forward(x.reshape((b * t, d))).reshape((b, t, d))
        return self._forward(x)

    def _forward(self, x):
        if self.kind == "swiglu":
            y = hs.silu(self.gate(x)) * self.up(x)
        elif self.kind == "geglu":
            y = hs.gelu(self.gate(x)) * self.up(x)
        elif self.kind == "relu":
            y = hs.relu(self.up(x))
        else:
            y = hs.gelu(self.up(x))
        return self.down(y)


class Layer(hs.nn.Module):
    """One transformer layer; returns (x, the MoE load-balancing loss or None)."""

    def __init__(self, s: dict, moe: bool) -> None:
        self.prenorm, self.dropout = s["prenorm"], s["dropout"]
        self.norm1, self.attn, self.norm2 = _norm(s), Attention(s), _norm(s)
        if moe:
            self.mlp = hs.nn.MoE(s["d_model"], s["d_ff"], s["experts"], s["top_k"], s["capacity"])
        else:
            self.mlp = FeedForward(s)
        self.moe = moe

    def _drop(self, y):
        return hs.dropout(y, self.dropout) if self.dropout else y

    def _mlp(self, x):
        if self.moe:
            y, aux = self.mlp(x)
            return self._drop(y), aux
        return self._drop(self.mlp(x)), None

    def forward(self, x):
        if self.prenorm:
            x = x + self._drop(self.attn(self.norm1(x)))
            y, aux = self._mlp(self.norm2(x))
            x = x + y
        else:
            x = self.norm1(x + self._drop(self.attn(x)))
            y, aux = self._mlp(x)
            x = self.norm2(x + y)
        return x if aux is None else (x, aux)


class FunctionLayer(Layer):
    """A `Layer` traced once into a function and called per layer (stacked where it can be)."""

    function = True


class Model(hs.nn.Module):
    def __init__(self, s: dict) -> None:
        self.s = s
        self.tok = hs.nn.Embedding(s["vocab"], s["d_model"], "normal:0.5")
        if s["positions"] == "learned":
            self.pos = hs.nn.Parameter((s["seq"], s["d_model"]), "normal:0.1")
        make = FunctionLayer if s["function"] else Layer
        self.layers = [make(s, i in s["moe"]) for i in range(s["layers"])]
        if s["final_norm"]:
            self.norm = _norm(s)
        if s["kind"] == "encoder":
            self.classify = hs.nn.Linear(s["d_model"], s["classes"])
        elif not s["tied"]:
            self.head = hs.nn.Linear(s["d_model"], s["vocab"], bias=False)

    def forward(self, ids):
        s = self.s
        x = self.tok(ids)
        if s["positions"] == "learned":
            x = x + self.pos.traced("add")
        if s["dropout"]:
            x = hs.dropout(x, s["dropout"])
        aux = None
        for layer in self.layers:
            x = layer(x)
            if isinstance(x, tuple):
                x, a = x
                aux = a if aux is None else aux + a
        if s["final_norm"]:
            x = self.norm(x)
        b, t, d = x.shape
        if s["kind"] == "encoder":
            pooled = hs.slice(x, 1, 0, 1).reshape((b, d)) if s["pool"] == "first" else x.sum([1]) * (1.0 / t)
            return self.classify(hs.tanh(pooled)), aux
        if s["tied"]:
            return x @ self.tok.weight.transpose((1, 0)), aux
        return self.head(x), aux


def model(config):
    return Model(_spec(config))


def loss(model, batch):
    logits, aux = model(batch["ids"])
    out = ops.cross_entropy(logits, batch["y"])
    return out if aux is None else out + aux * 0.01


def optimizer(config):
    s = _spec(config)
    clip = s["clip"] or None
    if s["optimizer"] == "adam":
        return hs.optim.Adam(1e-2, clip_grad_norm=clip)
    if s["optimizer"] == "adamw":
        return hs.optim.AdamW(1e-2, weight_decay=0.1, clip_grad_norm=clip)
    return hs.optim.SGD(0.5, clip_grad_norm=clip)


def batches(config):
    s = _spec(config)
    rng = np.random.default_rng(config["seed"])
    b, t = s["batch"], s["seq"]
    while True:
        ids = rng.integers(0, s["vocab"], (b, t)).astype(np.int32)
        if s["kind"] == "decoder":  # the next token, with a pattern worth learning
            y = np.roll(ids, -1, axis=1)
        else:
            y = (ids[:, 0] % s["classes"]).astype(np.int32)
        yield {"ids": ids, "y": y.astype(np.int32)}
