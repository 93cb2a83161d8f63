"""transformers' causal LMs from small configs: the zoo `tests/test_torch_zoo.py` imports.

`zoo()` lists the entries of transformers' causal-LM auto mapping; `small_config(model_type)`
makes one of them small (hidden size 64, 2 layers, 4 heads, a vocabulary of 256, 4 experts of
which 2 per token, dropout 0) from its default config by the settings it has, and
`build(model_type)` returns the model and its loss function on a batch `{"x", "y"}` of token ids
(cross-entropy of the logits, computed outside the model so every head is treated alike), or
the one-line reason it does not build as a decoder-only model from input ids alone.
"""

from __future__ import annotations

import numpy as np

D, FF, MOE_FF, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, POSITIONS = 64, 128, 32, 2, 4, 2, 16, 256, 64
BATCH, SEQ = 2, 16
#: a small config's model has fewer parameters than this, or is not built
MAX_PARAMETERS = 3_000_000
#: the experts of a small config's mixture-of-experts layer, and those each token picks
EXPERTS, TOP_K = 4, 2

#: every spelling of a size, in transformers' configs, and its small value
SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim", "n_embed"), D),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
                     "inner_hidden_size", "d_inner", "ffn_intermediate_size", "dense_intermediate_size"), FF),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
                     "moe_ffn_hidden_size", "moe_dim", "expert_dim"), MOE_FF),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads"), HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "head_size"), HEAD_DIM),
    **dict.fromkeys(("vocab_size", "n_vocab"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                     "max_sequence_length"), POSITIONS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "num_selected_experts"), TOP_K),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "first_k_dense_replace": 1, "rotary_dim": 8, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16,
    **dict.fromkeys(("emb_dim", "attention_hidden_size", "pronunciation_embed_dim", "shape_embed_dim", "ple_embed_dim"),
                    D),
    **dict.fromkeys(("dim_ff", "dff", "intermediate_size_mlp", "expert_ffn_hidden_size", "router_hidden_size"), FF),
    **dict.fromkeys(("dim_head", "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
                     "index_head_dim", "hidden_size_per_layer_input", "attention_head_dim"), HEAD_DIM),
    **dict.fromkeys(("vocab_size_per_layer_input", "unpadded_vocab_size", "pronunciation_vocab_size",
                     "shape_vocab_size"), VOCAB),
    "zero_expert_num": 1, "adapter_in_dim": D, "adapter_input_size": D,
    "num_kv_shared_layers": 0,  # the last layers reading earlier layers' keys and values: none of 2
    # state-space (Mamba-style) layers: 8 heads of HEAD_DIM (their product the expanded width
    # 2 * D), a small state, and chunks shorter than the batch's sequence (the scan crosses a chunk)
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), HEAD_DIM),
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "state_size"), 16),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), SEQ // 2),
    **dict.fromkeys(("mamba_d_ssm", "shared_intermediate_size"), FF),
    "moe_shared_expert_intermediate_size": MOE_FF,
}
#: the settings that name a count of layers (per-layer lists of that length are cut to LAYERS)
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
#: the multi-modal models of the mapping: their text models are in it too
MULTIMODAL = ("ForConditionalGeneration",)


def zoo() -> dict[str, str]:
    """Return transformers' causal-LM auto mapping: {model type: class name}."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def small_config(model_type: str, layers: int = LAYERS):
    """Return `model_type`'s default config made small (the settings above it has, `layers`
    layers, kv heads fewer than heads where the default has fewer, dropout 0, special tokens
    inside the vocabulary; the same for each of its sub-configs, a text model's for instance)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type).to_dict()
    return AutoConfig.for_model(model_type, **_small(default, layers))


def _small(default: dict, layers: int = LAYERS) -> dict:
    """Return the settings that make a config (as a dict) small, with `layers` layers (a per-layer
    list of the default's length is cut to its first `layers` entries, or its pattern carried on)."""
    kw = {k: v for k, v in SIZES.items() if k in default and not isinstance(default[k], (dict, list))}
    kw.update({k: layers for k in LAYER_COUNTS if k in kw})
    if "q_lora_rank" in default and default["q_lora_rank"] is not None:
        kw["q_lora_rank"] = 16
    for k in ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"):
        if isinstance(default.get(k), int):
            heads = next((default[h] for h in ("num_attention_heads", "n_head", "n_heads") if h in default), None)
            kw[k] = KV_HEADS if heads and default[k] < heads else HEADS
    for k, v in default.items():
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k or k.endswith("_drop")):
            kw[k] = 0.0
        if k.endswith("token_id") and isinstance(v, int) and v >= VOCAB:
            kw[k] = VOCAB - 1
        if k.endswith("token_id") and isinstance(v, list):
            kw[k] = [min(t, VOCAB - 1) for t in v]
    if "qk_rope_head_dim" in default:  # multi-head latent attention: its head dims go together
        kw["head_dim"] = kw["qk_rope_head_dim"] if "head_dim" in default else None
        kw = {k: v for k, v in kw.items() if v is not None}
        if "qk_head_dim" in default:
            kw["qk_head_dim"] = kw["qk_rope_head_dim"] + kw["qk_nope_head_dim"]
    if "expand" in default and "num_heads" in kw and "head_dim" in kw:  # Mamba-2: heads x head dim = expand x D
        kw["num_heads"] = int(default["expand"]) * D // kw["head_dim"]
    if "conv_L_cache" in default:  # LFM2: short-convolution and attention layers taking turns (the default has none)
        kw["layer_types"] = ["conv" if i % 2 == 0 else "full_attention" for i in range(layers)]
        kw["full_attn_idxs"] = [i for i in range(layers) if i % 2]
    if "indexer_budget" in default and default["indexer_budget"] is None:  # Qwen4-exp: its indexed layers need these
        kw.update(indexer_n_heads=HEADS, indexer_kv_heads=1, indexer_head_dim=HEAD_DIM, indexer_budget=8,
                  indexer_compress_ratio=4)
    hidden = next((default[k] for k in ("hidden_size", "d_model") if isinstance(default.get(k), int)), None)
    if isinstance(default.get("attention_hidden_size"), int) and hidden and default["attention_hidden_size"] % hidden == 0:
        kw["attention_hidden_size"] = D * default["attention_hidden_size"] // hidden  # Zamba's: twice the hidden size
    count = next((default[k] for k in LAYER_COUNTS if isinstance(default.get(k), int)), None)
    for k, v in default.items():  # per-layer settings: those of the first layers
        if isinstance(v, list) and count and len(v) == count and k in SIZES:  # a size per layer
            kw[k] = [SIZES[k]] * layers
        elif isinstance(v, list) and count and len(v) == count and k not in kw:
            kw[k] = _layers(v, layers)
            if kw[k] is None:
                raise NotInZoo(f"its per-layer setting {k} does not repeat: no config of {layers} layers from it")
        if k == "per_layer_config" and isinstance(v, dict) and count:  # Gemma-4's overrides, by layer number
            width = len(next(iter(v), ""))
            overrides = _layers([v.get(f"{i:0{width}d}", v.get(str(i))) for i in range(count)], layers)
            if overrides is None:
                raise NotInZoo(f"its {k} does not repeat: no config of {layers} layers from it")
            kw[k] = {f"{i:0{width}d}": c for i, c in enumerate(overrides) if c is not None}
    for k, v in default.items():  # sub-configs (a text model's, a vision model's)
        if isinstance(v, dict) and ("model_type" in v or any(key in v for key in SIZES)):
            kw[k] = {**v, **_small(v, layers)}
    return kw


def _layers(values: list, layers: int) -> list:
    """Return a per-layer list for `layers` layers: its first entries, or its pattern (those before
    the repeats, then the period: `hspmd.frontend.torch_repeats.repeat_pattern`) carried on."""
    from hspmd.frontend.torch_repeats import repeat_pattern

    start, period = repeat_pattern([repr(v) for v in values])
    if start + period > len(values):  # nothing repeats: its first entries only
        return list(values[:layers]) if layers <= len(values) else None
    return [values[i if i < start else start + (i - start) % period] for i in range(layers)]


def build(model_type: str, seed: int = 0, layers: int = LAYERS):
    """Return (model, loss_fn) of `model_type` from its small config with `layers` layers; raise
    `NotInZoo` with the reason where it is not a decoder-only model of input ids."""
    import torch
    from transformers import AutoModelForCausalLM

    if zoo()[model_type].endswith(MULTIMODAL):
        raise NotInZoo("a multi-modal model (its text model is an entry of its own)")
    config = small_config(model_type, layers)
    with torch.device("meta"):  # count first: a setting the small config missed must not fill the memory
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS * max(1, layers // LAYERS):
        raise NotInZoo(f"its small config still has {size:,} parameters (a size setting of its own)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()  # no dropout anywhere (hspmd's random masks are not PyTorch's)
    untie_routers(model, getattr(config, "initializer_range", 0.02), seed)
    return model, loss


#: the zoo's table as last run over the whole mapping (rows as `check` returns them, with "seconds")
TABLE = __import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)),
                                   "zoo_table.json")


def recorded_rows() -> list[dict]:
    """Return the rows of `TABLE`."""
    import json

    with open(TABLE) as f:
        return json.load(f)


def _which_config(model_type: str) -> str:
    """Return which config of `model_type` fails to build: "its default config either" or "a small config"."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception:  # noqa: BLE001 - transformers' own code
        return "its default config either"
    return "a small config"


def untie_routers(model, std: float, seed: int = 0) -> list[str]:
    """Give every router weight that starts at zero small random values (normal, `std`); return
    their names.

    AFMoE initialises its router to zero: every expert then scores alike for every token, and the
    top-k meets a tie in every row. PyTorch orders ties as its sort happens to (unspecified: the
    CPU's `nth_element` takes experts 2 and 3 of 4, CUDA others), hspmd the lower expert first, so
    the two would route every token to other experts and the comparison would be of two
    different, equally valid, routings. A trained checkpoint's router is never zero; with random
    values the routing is defined and the check compares the same one. A router weight here is a
    matrix named `router` or `gate` whose rows are the experts."""
    import torch

    names = [name for name, p in model.named_parameters()
             if p.ndim == 2 and p.shape[0] == EXPERTS and not p.detach().any()
             and any(part in ("router", "gate") for part in name.split(".")[:-1])]
    rng = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            params[name].copy_(torch.randn(params[name].shape, generator=rng) * std)
    return names


def loss(model, batch):
    """Return the mean cross-entropy of `model`'s logits of `batch["x"]` against `batch["y"]`."""
    import torch

    logits = model(input_ids=torch.as_tensor(batch["x"]).long(), use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             torch.as_tensor(batch["y"]).long().reshape(-1))


def batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Return a batch of token ids {"x": [B, T], "y": [B, T]} (the next tokens)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1), dtype=np.int64)
    return {"x": w[:, :-1], "y": w[:, 1:]}


class NotInZoo(Exception):
    """A model of the mapping that is not a decoder-only language model of input ids."""


# ----------------------------------------------------------------------------- one architecture through hspmd

ZOO_SCRIPT = __import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)),
                                        "torch_scripts", "zoo_model.py")


def rel(a, b) -> float:
    """Return ||a - b|| / ||b||."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def _run(script, bundle: str, strategy: str, n: int, steps: int, optimizer: bool):
    from hspmd.compiler import compile_script, write_bundle
    from hspmd.runtime.comm import run_spmd
    from hspmd.runtime.worker import train

    write_bundle(compile_script(script, strategy, n, optimizer=optimizer), bundle)
    return run_spmd(n, lambda comm: train(bundle, comm, steps=steps, quiet=True, keep_outputs=True))[0]


def check(arch: str, workdir: str, tp: bool = True, adamw: bool = True, layers: int = LAYERS) -> dict:
    """Return the zoo's row of `arch`: {"arch", "status" ("imported", "refused", "not in zoo",
    "differs"), "reason", "loss", "grad", "adamw", "tp"} (relative errors against PyTorch; "tp"
    the largest relative difference of two tp=2 losses from one device's, None without a plan or
    with `tp` False; "adamw" None with `adamw` False, which leaves the tp check out too), the model
    built with `layers` layers."""
    import os

    import torch

    from hspmd.frontend.script import load_script

    row = {"arch": arch, "status": "", "reason": "", "loss": None, "grad": None, "adamw": None, "tp": None}
    try:
        model, _ = build(arch, layers=layers)
    except NotInZoo as err:
        return {**row, "status": "not in zoo", "reason": str(err)}
    except Exception as err:  # noqa: BLE001 - transformers' own code fails on the small config
        return {**row, "status": "not in zoo", "reason": f"does not build from {_which_config(arch)}: {_line(err)}"}
    script = load_script(ZOO_SCRIPT, {"arch": arch, "layers": layers})
    try:
        first = _run(script, os.path.join(workdir, f"{arch}-grad"), "[0]: dp=1", 1, 1, False)
    except Exception as err:  # noqa: BLE001 - the import's one line
        return {**row, "status": "refused", "reason": _line(err)}
    b = {k: torch.as_tensor(v) for k, v in batch(0).items()}
    theirs = loss(model, b)
    theirs.backward()
    row["loss"] = rel(first.losses[0], theirs.item())
    grads = []
    for name, p in model.named_parameters():
        ours = first.outputs[0].get(f"grad:{name}")
        if p.grad is None or ours is None:
            continue
        g = p.grad.numpy()
        grads.append(0.0 if np.abs(g).max() < 1e-9 and np.abs(ours).max() < 1e-9 else rel(ours, g))
    row["grad"] = max(grads, default=0.0)
    if row["grad"] > 1e-4:  # an ill-conditioned loss? measured against float64, as PyTorch's float32 is
        row["grad64"] = float64_errors(arch, layers, first.outputs[0], b)
    if not adamw:
        row["status"] = "imported" if row["loss"] <= 1e-5 and grads_agree(row) else "differs"
        return row
    trained = _run(script, os.path.join(workdir, f"{arch}-adamw"), "[0]: dp=1", 1, 2, True)
    model, _ = build(arch, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=script.config["optim"]["lr"],
                            weight_decay=script.config["optim"]["weight_decay"])
    loss(model, b).backward()
    opt.step()
    second = loss(model, {k: torch.as_tensor(v) for k, v in batch(1).items()}).item()
    row["adamw"] = rel(trained.losses[1], second)  # the loss after one AdamW step, PyTorch's and hspmd's
    if tp and first_plan(model):
        two = _run(script, os.path.join(workdir, f"{arch}-tp"), "[0,1]: tp=2", 2, 2, True).losses
        row["tp"] = max(abs(a - c) / abs(c) for a, c in zip(two, trained.losses))
    ok = (row["loss"] <= 1e-5 and grads_agree(row) and row["adamw"] <= 1e-4
          and (row["tp"] is None or row["tp"] <= 1e-4))
    row["status"] = "imported" if ok else "differs"
    if row.get("grad64") and row["grad"] > 1e-4:
        ours, theirs = row["grad64"]
        row["reason"] = (f"gradients {ours:.1e} from float64's, PyTorch's float32 ones {theirs:.1e} (an ill-conditioned "
                         "loss: float32 rounding)")
    return row


def grads_agree(row: dict) -> bool:
    """Return whether hspmd's gradients are PyTorch's: within 1e-4 of them, or, where PyTorch's
    float32 gradients are themselves that far from float64's (a peaked softmax, a large loss),
    as close to float64's as PyTorch's are (`grad64`: hspmd's and PyTorch's float32 errors)."""
    if row["grad"] is not None and row["grad"] <= 1e-4:
        return True
    ours, theirs = row.get("grad64") or (None, None)
    return ours is not None and ours <= max(1e-4, 1.5 * theirs)


def float64_errors(arch: str, layers: int, outputs: dict, batch) -> tuple[float, float] | None:
    """Return (hspmd's, PyTorch's float32) largest relative gradient errors against PyTorch's
    gradients in float64 of the same model and batch; None where the model does not run in float64."""
    errors = []
    try:
        exact, _ = build(arch, layers=layers)
        exact = exact.double()
        loss(exact, batch).backward()
        single, _ = build(arch, layers=layers)
        loss(single, batch).backward()
    except Exception:  # noqa: BLE001 - kernels without float64 (grouped matmuls): no reference
        return None
    for (name, p), q in zip(exact.named_parameters(), single.parameters()):
        ours = outputs.get(f"grad:{name}")
        if p.grad is None or ours is None or p.grad.abs().max() < 1e-9:
            continue
        g = p.grad.numpy()
        errors.append((rel(ours, g), rel(q.grad.numpy(), g)))
    return (max(e[0] for e in errors), max(e[1] for e in errors)) if errors else None


def depth(arch: str, layers: tuple[int, int] = (LAYERS, 48), tries: int = 2) -> dict:
    """Return how `arch`'s compile grows with depth: {"arch", "ops": the op counts of the logical
    and physical programs, "seconds": `compile_script`'s time (the import included; the least of
    `tries` compiles), each at the two depths of `layers` (after one compile that warms the
    imports and caches), "ratio": the deeper's time over the shallower's, "repeated": {list:
    [start, period]} of the deeper's lists exported in part}."""
    import time

    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script

    ops, seconds = [], []
    compile_script(load_script(ZOO_SCRIPT, {"arch": arch, "layers": layers[0]}), "[0]: dp=1", 1)  # warm: imports, caches
    for n in layers:
        times = []
        for _ in range(tries):
            script = load_script(ZOO_SCRIPT, {"arch": arch, "layers": n})
            start = time.perf_counter()
            compiled = compile_script(script, "[0]: dp=1", 1)
            times.append(time.perf_counter() - start)
        seconds.append(round(min(times), 2))
        ops.append([sum(1 for _ in getattr(compiled, level).walk()) for level in ("logical", "physical")])
    repeated = {path: [p.start, p.period] for path, p in script.imported.repeated.items()}
    return {"arch": arch, "ops": ops, "seconds": seconds, "ratio": round(seconds[1] / seconds[0], 2),
            "repeated": repeated}


def first_plan(model) -> dict:
    """Return the model's own tp plan ({} where it defines none)."""
    from hspmd.frontend.torch_import import default_tp_plan

    return default_tp_plan(model)


def _line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def table(rows: list[dict]) -> str:
    """Return the zoo's rows as a Markdown table: architecture, status, the errors or the reason."""

    def num(x):
        return "" if x is None else f"{x:.1e}"

    lines = ["| architecture | status | loss | gradients | AdamW step | tp=2 | reason |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        reason = r["reason"].replace("|", "\\|")
        lines.append(f"| {r['arch']} | {r['status']} | {num(r['loss'])} | {num(r['grad'])} | {num(r['adamw'])} "
                     f"| {num(r['tp'])} | {reason} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """`python tests/torch_zoo.py [ARCH ...] [--json FILE] [--depth [--at 2,48]]`: check every
    architecture of the zoo (or those named), print each row as it is found and the table at the
    end; `--json` appends the rows; `--depth` measures the compile at 2 and 48 layers (`--at`: at
    those two depths) instead (`depth`)."""
    import json
    import tempfile
    import time

    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    at = (LAYERS, 48)
    if "--at" in argv:  # the two depths, `--at 48,96`
        i = argv.index("--at")
        at, argv = tuple(int(n) for n in argv[i + 1].split(",")), argv[:i] + argv[i + 2:]
    if "--depth" in argv:
        argv = [a for a in argv if a != "--depth"]
        for arch in argv or sorted(zoo()):
            try:
                row = depth(arch, at)
            except Exception as err:  # noqa: BLE001 - a row, not the end of the table
                row = {"arch": arch, "reason": _line(err)}
            print(json.dumps(row), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        return
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for arch in argv or sorted(zoo()):
            start = time.perf_counter()
            try:
                row = check(arch, work)
            except Exception as err:  # noqa: BLE001 - a row, not the end of the table
                row = {"arch": arch, "status": "differs", "reason": f"the check failed: {_line(err)}",
                       "loss": None, "grad": None, "adamw": None, "tp": None}
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))


if __name__ == "__main__":
    import sys

    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
    main(sys.argv[1:])
