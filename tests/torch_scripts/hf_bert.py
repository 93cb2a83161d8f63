"""A small BertForSequenceClassification (transformers, built from a config) on random token
sequences labelled by a rule of their bytes: the importer's tests' encoder model."""

import numpy as np

import hspmd as hs

config = {
    "model": {"vocab_size": 64, "seq_len": 16, "layers": 2, "heads": 4, "d_model": 32, "d_ff": 64, "labels": 3},
    "data": {"batch_size": 8},
    "optim": {"lr": 1e-3, "weight_decay": 0.1, "warmup": 0, "clip": 0.0},
    "microbatches": 1,
    "steps": 3,
    "seed": 0,
}

tp_plan = {
    "bert.encoder.layer.*.attention.self.query": "colwise",
    "bert.encoder.layer.*.attention.self.key": "colwise",
    "bert.encoder.layer.*.attention.self.value": "colwise",
    "bert.encoder.layer.*.attention.output.dense": "rowwise",
    "bert.encoder.layer.*.intermediate.dense": "colwise",
    "bert.encoder.layer.*.output.dense": "rowwise",
}


def torch_model(config):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    m = config["model"]
    torch.manual_seed(config["seed"])
    cfg = BertConfig(vocab_size=m["vocab_size"], hidden_size=m["d_model"], num_hidden_layers=m["layers"],
                     num_attention_heads=m["heads"], intermediate_size=m["d_ff"], max_position_embeddings=m["seq_len"],
                     num_labels=m["labels"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def torch_loss(model, batch):
    import torch

    return torch.nn.functional.cross_entropy(model(input_ids=batch["ids"]).logits, batch["label"])


def optimizer(config):
    o = config["optim"]
    return hs.optim.AdamW(o["lr"], weight_decay=o["weight_decay"])


def batches(config):
    m, b = config["model"], config["data"]["batch_size"]
    rng = np.random.default_rng(config["seed"])
    while True:
        ids = rng.integers(0, m["vocab_size"], (b, m["seq_len"]))
        yield {"ids": ids, "label": ids.sum(1) % m["labels"]}
