"""A byte-level LLaMA-style model (RMSNorm, rotary attention, SwiGLU) on pydoc's help topics.

    hspmd run -n 1 examples/llama.py --steps 200 --log llama.jsonl
    hspmd compile examples/llama.py --set model.layers=48 --dump-dir /tmp/llama48
"""

import hspmd as hs
from hspmd.frontend.transformer import LLaMA, GPTConfig, lm_loss
from hspmd.data.text import lm_windows, pydoc_text_bytes

config = {
    "model": {"vocab_size": 256, "seq_len": 64, "layers": 2, "heads": 4, "d_model": 128, "dropout": 0.0, "eps": 1e-6},
    "data": {"batch_size": 16},
    "optim": {"lr": 3e-3, "weight_decay": 0.1, "warmup": 20, "clip": 1.0},
    "precision": "float32",  # or bfloat16 / float16 (float32 master weights)
    "loss_scale": None,  # a static scale (None: 1024 for float16, else 1) or "dynamic" (GradScaler)
    "tf32": False,  # float32 products on TF32 tensor cores (a GPU run only)
    "microbatches": 1,  # with pp > 1: micro-batches per step, gradients summed
    "pipeline_schedule": "gpipe",  # or 1f1b
    "steps": 200,
    "seed": 0,
}


def model(config):
    return LLaMA(GPTConfig.from_dict(config["model"]))


def loss(model, batch):
    return lm_loss(model, batch)


def optimizer(config):
    o = config["optim"]
    schedule = hs.optim.WarmupCosine(o["warmup"], config["steps"], min_lr=o["lr"] / 10)
    return hs.optim.AdamW(o["lr"], weight_decay=o["weight_decay"], clip_grad_norm=o["clip"], schedule=schedule)


def batches(config):
    return lm_windows(pydoc_text_bytes(), config["data"]["batch_size"], config["model"]["seq_len"], config["seed"])
