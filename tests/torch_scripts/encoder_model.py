"""A small encoder of transformers (BERT, RoBERTa, DistilBERT: `--set arch=roberta`) with a
masked-LM head or a sequence-classification head (`--set head=classify`), trained on random
token sequences padded to the batch's length: an `attention_mask` from the batch, and for the
masked LM labels of -100 wherever no token is predicted."""

import numpy as np

import hspmd as hs

config = {"arch": "bert", "head": "mlm", "seed": 0, "steps": 2, "batch": 4, "seq": 12, "vocab": 96, "labels": 3,
          "optim": {"lr": 1e-2, "weight_decay": 0.1}}


def torch_model(config):
    import torch
    from transformers import (AutoConfig, AutoModelForMaskedLM, AutoModelForSequenceClassification)

    kw = dict(vocab_size=config["vocab"], hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64, max_position_embeddings=config["seq"] + 4, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, num_labels=config["labels"], pad_token_id=1)
    if config["arch"] == "distilbert":
        kw = dict(vocab_size=config["vocab"], dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                  max_position_embeddings=config["seq"] + 4, dropout=0.0, attention_dropout=0.0,
                  seq_classif_dropout=0.0, num_labels=config["labels"], pad_token_id=1)
    cfg = AutoConfig.for_model(config["arch"], **kw)
    torch.manual_seed(config["seed"])
    auto = AutoModelForMaskedLM if config["head"] == "mlm" else AutoModelForSequenceClassification
    return auto.from_config(cfg)


def torch_loss(model, batch):
    labels = batch["labels"].long()
    return model(input_ids=batch["ids"].long(), attention_mask=batch["mask"].long(), labels=labels).loss


def optimizer(config):
    return hs.optim.AdamW(config["optim"]["lr"], weight_decay=config["optim"]["weight_decay"])


def batches(config):
    rng = np.random.default_rng(config["seed"])
    b, t, v = config["batch"], config["seq"], config["vocab"]
    while True:
        lengths = rng.integers(t // 2, t + 1, size=b)
        lengths[0] = t
        mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int64)
        ids = np.where(mask == 1, rng.integers(3, v, size=(b, t)), 1)
        if config["head"] == "mlm":
            picked = (rng.random((b, t)) < 0.3) & (mask == 1)
            picked[0, 0] = True
            labels = np.where(picked, ids, -100)
            ids = np.where(picked, 2, ids)  # the [MASK] token
        else:
            labels = ids[:, 1] % config["labels"]
        yield {"ids": ids.astype(np.int64), "mask": mask, "labels": labels.astype(np.int64)}
