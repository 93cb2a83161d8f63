"""A small encoder-decoder of transformers (T5, BART: `--set arch=bart`) trained to map random
token sequences to others: the loss is the model's own (`labels` shifted into the decoder's
inputs by the model itself)."""

import numpy as np

import hspmd as hs

config = {"arch": "t5", "seed": 0, "steps": 2, "batch": 4, "src": 10, "tgt": 8, "vocab": 64,
          "optim": {"lr": 1e-2, "weight_decay": 0.1}}


def torch_model(config):
    import torch
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    v = config["vocab"]
    if config["arch"] == "t5":
        kw = dict(vocab_size=v, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, dropout_rate=0.0,
                  decoder_start_token_id=0, pad_token_id=0)
    else:
        kw = dict(vocab_size=v, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                  max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                  decoder_start_token_id=2)
    torch.manual_seed(config["seed"])
    return AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model(config["arch"], **kw))


def torch_loss(model, batch):
    return model(input_ids=batch["src"].long(), labels=batch["tgt"].long()).loss


def optimizer(config):
    return hs.optim.AdamW(config["optim"]["lr"], weight_decay=config["optim"]["weight_decay"])


def batches(config):
    rng = np.random.default_rng(config["seed"])
    while True:
        yield {"src": rng.integers(3, config["vocab"], size=(config["batch"], config["src"])),
               "tgt": rng.integers(3, config["vocab"], size=(config["batch"], config["tgt"]))}
