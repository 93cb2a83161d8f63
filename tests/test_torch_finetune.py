"""Fine-tuning imported Hugging Face models as users do: padding masks and labels -100 from the
batch, 16-bit precision as under `torch.autocast`, pretrained weights in (`from_pretrained`) and
out (`hspmd checkpoint export --hf`).

* `examples/hf_finetune.py` (a LLaMA from a `save_pretrained` directory, left-padded SFT batches:
  some query rows see no key at all) has PyTorch's loss and every gradient under dp=2, tp=2 or
  pp=2 (1e-5; one of the three per run, by the run's seed `HSPMD_TEST_SEED`);
* `precision=bfloat16` or `float16` (one per run) on `examples/hf_llama.py`: ten AdamW steps within 1e-2
  (relative) of PyTorch's under `torch.autocast`, on float32 master weights;
* a tiny tied LLaMA saved with `save_pretrained`, fine-tuned 4 steps under tp=2, exported with
  `--hf`: `from_pretrained` loads it with no key missing or unexpected, and PyTorch's loss on the
  next batch is hspmd's;
* the new error paths are one line each (an export --hf of no transformers model's checkpoint, or of
  one that lacks state_dict entries; a `pretrained` directory that is not there; a bad precision).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import EXAMPLES, sampled

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402
from hspmd.compiler import compile_script, write_bundle  # noqa: E402
from hspmd.frontend.script import ScriptError, load_script, parse_overrides  # noqa: E402
from hspmd.runtime.checkpoint.manifest import CheckpointError  # noqa: E402
from hspmd.runtime.checkpoint.tools import export_hugging_face  # noqa: E402
from hspmd.runtime.comm import run_spmd  # noqa: E402
from hspmd.runtime.worker import CheckpointOptions, train  # noqa: E402

FINETUNE = os.path.join(EXAMPLES, "hf_finetune.py")
TINY = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.kv_heads=2", "model.d_ff=64",
        "model.seq_len=16", "data.batch_size=4", "data.min_prompt=3", "data.min_answer=3", "optim.clip=0.0",
        "optim.warmup=0"]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def torch_batch(batch):
    return {k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}


def run(script, tmp_path, strategy, n, steps, optimizer=True, checkpoints=None):
    bundle = tmp_path / ("b" + "".join(c for c in strategy if c.isalnum()) + str(optimizer))
    write_bundle(compile_script(script, strategy, n, optimizer=optimizer), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=steps, quiet=True, keep_outputs=True,
                                          checkpoints=checkpoints))


@pytest.mark.parametrize("strategy", sampled(["[0,1]: dp=2", "[0,1]: tp=2", "[0,1]: pp=2"], 1, "masks"))
def test_padding_masks_and_ignored_labels_give_pytorchs_loss_and_gradients(tmp_path, strategy):
    """Left padding (rows of the attention that keep no key give 0, as PyTorch's do), labels -100 on
    the prompt and the padding (the mean over the labels kept, across the dp ranks): loss and every
    gradient equal PyTorch's, the ranks' gradients put together."""
    script = load_script(FINETUNE, parse_overrides(TINY + ["data.padding=left"]))
    results = run(script, tmp_path, strategy, 2, steps=1, optimizer=False)
    module = script.module.torch_model(script.config)
    batch = torch_batch(next(script.batches()))
    assert (batch["attention_mask"][:, 0] == 0).any() and (batch["labels"] == -100).any()
    loss = script.module.torch_loss(module, batch)
    loss.backward()
    grads = {k: v for r in results for k, v in r.outputs[0].items() if k.startswith("grad:")}
    assert {f"grad:{k}" for k, _ in module.named_parameters()} == set(grads)
    for r in results:
        assert rel(r.losses[0], loss.item()) <= 1e-5, (strategy, r.losses, loss.item())
    for name, p in module.named_parameters():
        assert rel(grads[f"grad:{name}"], p.grad.numpy()) <= 1e-5, (strategy, name)


@pytest.mark.parametrize("precision", sampled(["bfloat16", "float16"], 1, "precision"))
def test_reduced_precision_imported_losses_follow_torch_autocast(tmp_path, precision):
    """Ten AdamW steps of `examples/hf_llama.py` with `precision`: the products in 16 bits, float32
    master weights; the losses within 1e-2 (relative) of PyTorch's under torch.autocast."""
    script = load_script(os.path.join(EXAMPLES, "hf_llama.py"), parse_overrides(
        ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "model.d_ff=64",
         "data.batch_size=4", "optim.clip=0.0", "optim.warmup=2", "steps=10", f"precision={precision}"]))
    compiled = compile_script(script, "[0]: dp=1", 1)
    text = str(compiled.logical)
    short = {"bfloat16": "bf16", "float16": "f16"}[precision]
    assert f"x{short}>" in text and "graph.matmul" in text
    write_bundle(compiled, str(tmp_path / "b"))
    ours = run_spmd(1, lambda comm: train(str(tmp_path / "b"), comm, steps=10, quiet=True))[0]
    assert all(v.dtype == np.float32 for k, v in ours.params.items() if not k.startswith("opt."))
    module = script.module.torch_model(script.config)
    o = script.config["optim"]
    opt = torch.optim.AdamW(module.parameters(), lr=o["lr"], weight_decay=o["weight_decay"])
    batches, theirs = script.batches(), []
    for step in range(10):
        for group in opt.param_groups:
            group["lr"] = ours.lrs[step]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=getattr(torch, precision)):
            loss = script.module.torch_loss(module, torch_batch(next(batches)))
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    err = np.abs(np.asarray(ours.losses) / np.asarray(theirs) - 1)
    assert err.max() <= 1e-2, (ours.losses, theirs)
    assert ours.losses[-1] < ours.losses[0] - 0.2


def save_tiny_llama(path, tie: bool = True):
    """Save a small LLaMA of the TINY settings with save_pretrained (tied embedding and head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=tie,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def test_pretrained_weights_in_and_out_under_tp(tmp_path):
    """save_pretrained a tied LLaMA, fine-tune it 4 steps under tp=2 from those weights, export
    step 4 with --hf: from_pretrained loads it with nothing missing or unexpected (the head tied
    again), its weights are the trained ones, and PyTorch's loss on batch 5 is hspmd's step 5."""
    from transformers import AutoModelForCausalLM

    pretrained = save_tiny_llama(tmp_path / "pretrained")
    script = load_script(FINETUNE, parse_overrides(TINY + [f"pretrained={pretrained}"]))
    ck = str(tmp_path / "ck")
    results = run(script, tmp_path, "[0,1]: tp=2", 2, steps=5, checkpoints=CheckpointOptions(directory=ck, every=4))
    start = AutoModelForCausalLM.from_pretrained(pretrained)
    assert rel(results[0].initial_params["model.embed_tokens.weight"], start.model.embed_tokens.weight.detach()) == 0

    out = tmp_path / "tuned"
    assert "LlamaForCausalLM" in export_hugging_face(os.path.join(ck, "step-4"), str(out))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    from safetensors.numpy import load_file

    written = load_file(str(out / "model.safetensors"))
    assert "model.embed_tokens.weight" in written and "lm_head.weight" not in written  # tied: once
    tuned, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info.values()), info
    assert tuned.lm_head.weight is tuned.model.embed_tokens.weight
    batches = script.batches()
    for _ in range(4):
        next(batches)
    loss = script.module.torch_loss(tuned, torch_batch(next(batches))).item()
    assert rel(results[0].losses[4], loss) <= 1e-5, (results[0].losses, loss)


def test_export_hf_error_paths_are_one_line(tmp_path, cli):
    """--hf of a checkpoint of no transformers model, of one lacking state_dict entries, with --to;
    and a `pretrained` directory that is not there."""
    mlp = load_script(os.path.join(EXAMPLES, "mlp.py"))
    run(mlp, tmp_path, "[0]: dp=1", 1, steps=1, checkpoints=CheckpointOptions(directory=str(tmp_path / "ck")))
    with pytest.raises(CheckpointError, match="not a Hugging Face model's checkpoint.*--to FILE.safetensors"):
        export_hugging_face(str(tmp_path / "ck"), str(tmp_path / "out"))
    proc = cli("hspmd", "checkpoint", "export", str(tmp_path / "ck"), "--hf", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "not a Hugging Face model" in proc.stderr
    proc = cli("hspmd", "checkpoint", "export", str(tmp_path / "ck"), "--hf", str(tmp_path / "out"), "--to",
               str(tmp_path / "x.safetensors"), timeout=120)
    assert proc.returncode == 1 and "takes neither --to nor --optimizer" in proc.stderr

    # a checkpoint whose model has state_dict entries the program does not hold
    manifest = tmp_path / "ck" / "step-1" / "manifest.json"
    text = json.loads(manifest.read_text())
    text["config"]["hf"] = {"config": {"model_type": "llama"}, "tied": [], "absent": ["lm_head.weight"]}
    manifest.write_text(json.dumps(text))
    with pytest.raises(CheckpointError, match=r"lacks 1 entry of the model's state_dict \(lm_head.weight\)"):
        export_hugging_face(str(tmp_path / "ck"), str(tmp_path / "out"))

    script = load_script(FINETUNE, parse_overrides(TINY + [f"pretrained={tmp_path / 'nowhere'}"]))
    with pytest.raises(ScriptError, match="torch_model.*FileNotFoundError: pretrained=.*nowhere.*no config.json"):
        compile_script(script, "[0]: dp=1", 1)


def test_what_the_program_lacks_of_a_state_dict_is_recorded(tmp_path):
    """The import records the model's config.json, and the state_dict entries the program lacks
    (a head the loss does not use), which `export --hf` then refuses to leave out silently (the
    tied weights it leaves out on purpose: `test_pretrained_weights_in_and_out_under_tp`)."""
    from transformers import AutoModelForCausalLM

    untied = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "untied", tie=False))
    batch = {"input_ids": np.zeros((2, 8), np.int64)}
    body = hs.from_torch(untied, batch, lambda m, b: m.model(input_ids=b["input_ids"]).last_hidden_state.pow(2).mean())
    assert body.hf["config"]["architectures"] == ["LlamaForCausalLM"] and body.hf["config"]["hidden_size"] == 32
    assert body.hf["absent"] == ["lm_head.weight"] and not body.hf["tied"]


def test_a_bad_precision_of_an_imported_model_is_one_line():
    script = load_script(os.path.join(EXAMPLES, "hf_llama.py"), parse_overrides(["precision=float8"]))
    with pytest.raises(ScriptError, match="precision='float8': expected float32, bfloat16 or float16"):
        compile_script(script, "[0]: dp=1", 1)
