"""Fine-tune a Hugging Face causal LM from a `save_pretrained` directory, as SFT scripts do: the
batch holds `input_ids`, a padding `attention_mask` and `labels` with -100 on the prompt and the
padding; the loss is the model's own (`model(**batch).loss`). Export the result back as a
directory transformers loads. Needs the `torch` extra (`pip install -e '.[torch]'`).

    hspmd run -n 2 examples/hf_finetune.py --strategy "[0,1]: tp=2" --steps 4 --checkpoint-dir ck --checkpoint-every 4
    hspmd checkpoint export ck --hf tuned          # config.json + model.safetensors
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('tuned')"

`pretrained` names the directory to start from (any `save_pretrained` of a causal LM whose ops
the importer translates). Left empty, the example makes one itself, so nothing is downloaded: a
small LLaMA (transformers' `LlamaForCausalLM`, from the `model` settings) saved with
`save_pretrained` under the temporary directory, once per setting. The data are the English text
of `examples/gpt.py` as bytes: each example is a prompt and its continuation, of random lengths,
padded to `seq_len` (on the right; `--set data.padding=left` for the left); only the
continuation is learned (`labels` -100 elsewhere).
"""

import hashlib
import json
import os
import tempfile

import numpy as np

import hspmd as hs
from hspmd.runtime.data import pydoc_text_bytes

config = {
    "model": {"vocab_size": 256, "seq_len": 64, "layers": 2, "heads": 4, "kv_heads": 2, "d_model": 128, "d_ff": 256},
    "pretrained": "",  # a save_pretrained directory; "" makes a small LLaMA (see above)
    "data": {"batch_size": 16, "min_prompt": 8, "min_answer": 8, "padding": "right"},  # or left
    "optim": {"lr": 1e-3, "weight_decay": 0.0, "warmup": 10, "clip": 1.0},
    "precision": "float32",  # or bfloat16 / float16: as torch.autocast computes, float32 master weights
    "microbatches": 1,
    "pipeline_schedule": "gpipe",
    "steps": 100,
    "seed": 0,
}

PAD = 0  # the padding token (its label is -100, its mask 0)


def pretrained_dir(config) -> str:
    """Return the directory to fine-tune from: `pretrained`, or a small LLaMA saved once with
    `save_pretrained` under the temporary directory (named after its settings)."""
    if config["pretrained"]:
        return config["pretrained"]
    key = json.dumps([config["model"], config["seed"]], sort_keys=True)
    path = os.path.join(tempfile.gettempdir(), "hspmd-hf-finetune-" + hashlib.sha1(key.encode()).hexdigest()[:12])
    if not os.path.isfile(os.path.join(path, "config.json")):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        m = config["model"]
        torch.manual_seed(config["seed"])
        cfg = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["d_ff"],
                          num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                          num_key_value_heads=m["kv_heads"], max_position_embeddings=m["seq_len"],
                          bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
        tmp = f"{path}.tmp{os.getpid()}"
        LlamaForCausalLM(cfg).save_pretrained(tmp)
        try:
            os.rename(tmp, path)  # another process may have made it meanwhile: theirs is the same
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


def torch_model(config):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    path = pretrained_dir(config)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"pretrained={path!r}: not a save_pretrained directory (no config.json there)")
    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True)


def torch_loss(model, batch):
    out = model(input_ids=batch["input_ids"].long(), attention_mask=batch["attention_mask"].long(),
                labels=batch["labels"].long(), use_cache=False)
    return out.loss


def optimizer(config):
    o = config["optim"]
    schedule = hs.optim.WarmupCosine(o["warmup"], config["steps"], min_lr=o["lr"] / 10)
    return hs.optim.AdamW(o["lr"], weight_decay=o["weight_decay"], clip_grad_norm=o["clip"], schedule=schedule)


def batches(config):
    """Yield SFT batches: a prompt and its continuation from the text, padded to seq_len (on the
    right, or with `padding` "left" on the left)."""
    text = np.frombuffer(pydoc_text_bytes(), dtype=np.uint8)
    b, t, d = config["data"]["batch_size"], config["model"]["seq_len"], config["data"]
    rng = np.random.default_rng(config["seed"])
    while True:
        ids = np.full((b, t), PAD, dtype=np.int64)
        mask = np.zeros((b, t), dtype=np.int64)
        labels = np.full((b, t), -100, dtype=np.int64)
        for row in range(b):
            prompt = int(rng.integers(d["min_prompt"], t - d["min_answer"]))
            length = int(rng.integers(prompt + d["min_answer"], t + 1))
            start = int(rng.integers(0, len(text) - length))
            ids[row, :length] = text[start:start + length]
            mask[row, :length] = 1
            labels[row, prompt:length] = ids[row, prompt:length]
            if d["padding"] == "left":
                for a in (ids, mask, labels):
                    a[row] = np.roll(a[row], t - length)
        yield {"input_ids": ids, "attention_mask": mask, "labels": labels}
