"""A Hugging Face LLaMA (transformers' `LlamaForCausalLM`, built from a small config: nothing is
downloaded; RMSNorm, rotary attention with grouped key/value heads, SwiGLU) imported from
PyTorch and trained on the English text of `examples/gpt.py`, bytes as tokens. Needs the `torch`
extra (`pip install -e '.[torch]'`).

    hspmd run -n 1 examples/hf_llama.py --steps 50 --log llama.jsonl
    hspmd run -n 2 examples/hf_llama.py --strategy "[0,1]: tp=2"   # tp from LLaMA's own base_model_tp_plan

With no `tp_plan` in the script, tensor parallelism follows the model's own plan (transformers'
`base_model_tp_plan` and its head's); see `docs/torch-import.md`.
"""

import hspmd as hs
from hspmd.data.text import lm_windows, pydoc_text_bytes

config = {
    "model": {"vocab_size": 256, "seq_len": 64, "layers": 2, "heads": 4, "kv_heads": 2, "d_model": 128, "d_ff": 256},
    "data": {"batch_size": 16},
    "optim": {"lr": 3e-3, "weight_decay": 0.1, "warmup": 20, "clip": 1.0},
    "microbatches": 1,  # with pp > 1: micro-batches per step, gradients summed
    "pipeline_schedule": "gpipe",  # or 1f1b
    "steps": 200,
    "seed": 0,
}


def torch_model(config):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = config["model"]
    torch.manual_seed(config["seed"])
    cfg = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["d_ff"],
                      num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                      max_position_embeddings=m["seq_len"], bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return LlamaForCausalLM(cfg)


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
