"""A GPT trained on English text that ships with Python (pydoc's help topics, as bytes), or on a
token dataset prepared from your own text (docs/data.md):

    hspmd run -n 1 examples/gpt.py --steps 200 --log gpt.jsonl
    hspmd compile examples/gpt.py --set model.layers=48 --dump-dir /tmp/gpt48
    hspmd data prepare corpus/*.txt --tokenizer bpe:8192 -o ds
    hspmd run -n 2 examples/gpt.py --set data.path=ds       # the vocabulary is the dataset's
"""

import hspmd as hs
from hspmd.data.text import pydoc_text_bytes
from hspmd.frontend.transformer import GPT, GPTConfig, lm_loss

config = {
    # vocab_size: of the pydoc bytes (under 256: the bytes modulo it); with data.path the dataset's vocabulary is used instead
    "model": {"vocab_size": 256, "seq_len": 64, "layers": 2, "heads": 4, "d_model": 128, "dropout": 0.0},
    # path: a directory from `hspmd data prepare` (None: pydoc's text); prefetch: batches made ahead;
    # packed: whole documents packed into the windows, attention kept within each (HetSeq, docs/data.md)
    "data": {"batch_size": 16, "path": None, "prefetch": 2, "packed": False},
    "optim": {"lr": 3e-3, "weight_decay": 0.1, "warmup": 20, "clip": 1.0},
    "precision": "float32",  # or bfloat16 / float16 (float32 master weights)
    "loss_scale": None,  # a static scale (None: 1024 for float16, else 1) or "dynamic" (GradScaler)
    "tf32": False,  # float32 products on TF32 tensor cores (a GPU run only)
    "microbatches": 1,  # with pp > 1: micro-batches per step, gradients summed
    "pipeline_schedule": "gpipe",  # or 1f1b
    "steps": 200,
    "seed": 0,
}


def vocab_size(config):
    """The model's vocabulary: the prepared dataset's (data.path), else model.vocab_size."""
    path = config["data"]["path"]
    return hs.data.vocab_size(path) if path else config["model"]["vocab_size"]


def packed(config):
    return str(config["data"]["packed"]).lower() == "true"


def model(config):
    return GPT(GPTConfig.from_dict({**config["model"], "vocab_size": vocab_size(config),
                                    "document_mask": packed(config)}))


def loss(model, batch):
    return lm_loss(model, batch)


def optimizer(config):
    o = config["optim"]
    schedule = hs.optim.WarmupCosine(o["warmup"], config["steps"], min_lr=o["lr"] / 10)
    return hs.optim.AdamW(o["lr"], weight_decay=o["weight_decay"], clip_grad_norm=o["clip"], schedule=schedule)


def pydoc_tokens(vocab: int):
    """The pydoc bytes as an in-memory corpus; a vocabulary under 256 takes them modulo its size."""
    data = pydoc_text_bytes()
    return hs.data.tokens(data % vocab if vocab < 256 else data, vocab_size=min(vocab, 256))


def dataset(config):
    """Windows of seq_len + 1 tokens (rows ids and targets; packed: and segments), shuffled each epoch by the seed."""
    path = config["data"]["path"]
    corpus = hs.data.TokenDataset(path) if path else pydoc_tokens(config["model"]["vocab_size"])
    view = corpus.packed if packed(config) else corpus.windows
    return view(config["model"]["seq_len"] + 1, vocab_size=vocab_size(config))
