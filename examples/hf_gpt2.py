"""A Hugging Face GPT-2 (transformers' `GPT2LMHeadModel`, built from a small config: nothing is
downloaded) imported from PyTorch and trained on the English text of `examples/gpt.py`, bytes as
tokens. Needs the `torch` extra (`pip install -e '.[torch]'`).

    hspmd run -n 1 examples/hf_gpt2.py --steps 50 --log gpt2.jsonl
    hspmd run -n 2 examples/hf_gpt2.py --strategy "[0,1]: tp=2"       # tp from `tp_plan` below
    hspmd compile examples/hf_gpt2.py --set model.layers=48 --dump-dir /tmp/gpt2-48

`torch_model` builds the module, `torch_loss` is the loss as PyTorch computes it; hspmd imports
it through `torch.export` (`docs/torch-import.md`), with the parameters' PyTorch names
(`transformer.h.0.attn.c_attn.weight`), and starts from the module's weights.
"""

import hspmd as hs
from hspmd.data.text import lm_windows, pydoc_text_bytes

config = {
    "model": {"vocab_size": 256, "seq_len": 64, "layers": 2, "heads": 4, "d_model": 128},
    "data": {"batch_size": 16},
    "optim": {"lr": 3e-3, "weight_decay": 0.1, "warmup": 20, "clip": 1.0},
    "microbatches": 1,  # with pp > 1: micro-batches per step, gradients summed
    "pipeline_schedule": "gpipe",  # or 1f1b
    "steps": 200,
    "seed": 0,
}

#: GPT-2 defines no tensor-parallel plan of its own; in parallelize_module's terms (its layers are
#: transformers' Conv1D, weight [in, out]: the importer splits the matching dims)
tp_plan = {
    "transformer.h.*.attn.c_attn": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}


def torch_model(config):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    m = config["model"]
    torch.manual_seed(config["seed"])
    cfg = GPT2Config(vocab_size=m["vocab_size"], n_positions=m["seq_len"], n_embd=m["d_model"], n_layer=m["layers"],
                     n_head=m["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def torch_loss(model, batch):
    import torch

    logits = model(input_ids=batch["ids"].long(), use_cache=False).logits  # the batch holds int32 bytes
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].long().reshape(-1))


def optimizer(config):
    o = config["optim"]
    schedule = hs.optim.WarmupCosine(o["warmup"], config["steps"], min_lr=o["lr"] / 10)
    return hs.optim.AdamW(o["lr"], weight_decay=o["weight_decay"], clip_grad_norm=o["clip"], schedule=schedule)


def batches(config):
    return lm_windows(pydoc_text_bytes(), config["data"]["batch_size"], config["model"]["seq_len"], config["seed"])
