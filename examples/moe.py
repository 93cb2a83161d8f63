"""The GPT example with a mixture-of-experts MLP in every other block, on the same text.

    hspmd run -n 1 examples/moe.py --steps 8 --log moe.jsonl
    hspmd run -n 2 examples/moe.py --steps 8 --strategy "[0,1]: ep=2"
    hspmd run -n 4 examples/moe.py --steps 8 --strategy "[0-3]: dp=2 ep=2"

Each sequence is one routing group (top-k experts per token, a capacity per expert and
sequence, tokens past it dropped), so every strategy drops the same tokens and trains the
same numbers as one device.
"""

import hspmd as hs
from hspmd.frontend.transformer import GPTConfig, MoEGPT, moe_lm_loss
from hspmd.data.text import lm_windows, pydoc_text_bytes

config = {
    "model": {"vocab_size": 256, "seq_len": 64, "layers": 2, "heads": 4, "d_model": 64, "d_ff": 128,
              "dropout": 0.0, "experts": 4, "top_k": 2, "capacity_factor": 1.0,
              "aux_loss": 0.01},  # the weight of the load-balancing loss in the training loss
    "data": {"batch_size": 16},
    "optim": {"lr": 3e-3, "weight_decay": 0.1, "warmup": 20, "clip": 1.0},
    "precision": "float32",
    "loss_scale": None,
    "tf32": False,  # float32 products on TF32 tensor cores (a GPU run only)
    "microbatches": 1,
    "pipeline_schedule": "gpipe",
    "steps": 200,
    "seed": 0,
}


def model(config):
    return MoEGPT(GPTConfig.from_dict(config["model"]))


def loss(model, batch):
    return moe_lm_loss(model, batch)


def optimizer(config):
    o = config["optim"]
    schedule = hs.optim.WarmupCosine(o["warmup"], config["steps"], min_lr=o["lr"] / 10)
    return hs.optim.AdamW(o["lr"], weight_decay=o["weight_decay"], clip_grad_norm=o["clip"], schedule=schedule)


def batches(config):
    return lm_windows(pydoc_text_bytes(), config["data"]["batch_size"], config["model"]["seq_len"], config["seed"])
