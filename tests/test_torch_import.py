"""Importing PyTorch models (`hs.from_torch`, `torch_model` scripts): the imported logical program
computes PyTorch's numbers.

For transformers' GPT2LMHeadModel, LlamaForCausalLM and BertForSequenceClassification built from
small configs: the loss and every gradient equal PyTorch's (relative error per tensor <= 1e-5),
and three AdamW steps equal `torch.optim.AdamW`'s. Also: repeated blocks become one function and
one stacked scan, a tp plan in PyTorch's terms lays the weights out, an unsupported op is one
line naming it, and an exported checkpoint loads into the module.

The strategy sweep is sampled per run: the three models take turns (by the run's seed,
`HSPMD_TEST_SEED`, printed in pytest's header; the test ids name the pairs), so that every run
trains each strategy on one model and successive runs every model under every strategy.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import EXAMPLES, ROOT, RUN_SEED

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[torch]')")

import hspmd as hs  # noqa: E402
from hspmd.compiler import compile_script, write_bundle  # noqa: E402
from hspmd.frontend.script import load_script, parse_overrides  # noqa: E402
from hspmd.runtime.comm import run_spmd  # noqa: E402
from hspmd.runtime.worker import train  # noqa: E402

BERT = os.path.join(ROOT, "tests", "torch_scripts", "hf_bert.py")
SMALL_LM = ["model.layers=2", "model.d_model=32", "model.heads=4", "model.seq_len=16", "data.batch_size=4",
            "optim.clip=0.0"]
CASES = {
    "gpt2": (os.path.join(EXAMPLES, "hf_gpt2.py"), SMALL_LM),
    "llama": (os.path.join(EXAMPLES, "hf_llama.py"), SMALL_LM + ["model.d_ff=64"]),
    "bert": (BERT, []),
}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def run_hspmd(script, tmp_path, steps, optimizer=True, strategy="[0]: dp=1", n=1):
    bundle = tmp_path / f"b{steps}{optimizer}{n}"
    bundle.parent.mkdir(parents=True, exist_ok=True)
    write_bundle(compile_script(script, strategy, n, optimizer=optimizer), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=steps, quiet=True, keep_outputs=True))[0]


def torch_batch(batch):
    return {k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_gradients_and_three_adamw_steps_equal_pytorch(tmp_path, case):
    path, overrides = CASES[case]
    script = load_script(path, parse_overrides(overrides))
    module = script.module.torch_model(script.config)
    first = run_hspmd(script, tmp_path, steps=1, optimizer=False)
    batch = torch_batch(next(script.batches()))
    loss = script.module.torch_loss(module, batch)
    loss.backward()
    assert rel(first.losses[0], loss.item()) <= 1e-5
    params = dict(module.named_parameters())  # tied weights once, under their first name
    assert {f"grad:{k}" for k in params} == {k for k in first.outputs[0] if k.startswith("grad:")}
    for name, p in params.items():
        assert rel(first.initial_params[name], p.detach().numpy()) == 0, name
        ours = first.outputs[0][f"grad:{name}"]
        if np.abs(p.grad.numpy()).max() < 1e-9:  # a key bias: zero but for rounding, in both
            assert np.abs(ours).max() < 1e-9, name
        else:
            assert rel(ours, p.grad.numpy()) <= 1e-5, name

    trained = run_hspmd(script, tmp_path, steps=3)
    module = script.module.torch_model(script.config)
    o = script.config["optim"]
    opt = torch.optim.AdamW(module.parameters(), lr=o["lr"], weight_decay=o["weight_decay"])
    batches = script.batches()
    for step in range(3):
        for group in opt.param_groups:
            group["lr"] = trained.lrs[step] if trained.lrs else o["lr"]
        opt.zero_grad()
        script.module.torch_loss(module, torch_batch(next(batches))).backward()
        opt.step()
    for name, p in module.named_parameters():
        ours, theirs = trained.params[name], p.detach().numpy()
        if name.endswith(("c_attn.bias", "attention.self.key.bias")):
            # the key bias has an exactly zero gradient (softmax ignores a per-row constant), so Adam
            # turns rounding noise into steps of up to lr each way: compare it within that
            d = ours.shape[0] // 3 if name.endswith("c_attn.bias") else 0
            key = slice(d, 2 * d) if d else slice(None)
            assert np.abs(ours[key] - theirs[key]).max() <= 2 * 3 * o["lr"], name
            ours, theirs = np.delete(ours, np.r_[key], 0) if d else ours[:0], np.delete(theirs, np.r_[key], 0) if d else theirs[:0]
            if not ours.size:
                continue
        assert rel(ours, theirs) <= 1e-5, name


STRATEGIES = [(2, "[0,1]: dp=2"), (2, "[0,1]: tp=2"), (2, "[0,1]: pp=2"), (3, "[0-2]: dp=3"),
              (3, "[0,1]: dp=2 share=3 | [2]: dp=1 share=1")]


#: this run's strategies per model: strategy i goes to model (i + seed) mod 3, each once per run
TURNS = {case: [s for i, s in enumerate(STRATEGIES) if (i + RUN_SEED) % len(CASES) == k]
         for k, case in enumerate(sorted(CASES))}


@pytest.mark.parametrize("case,strategies", sorted(TURNS.items()),
                         ids=[f"{c}:{'+'.join(s for _, s in v)}" for c, v in sorted(TURNS.items())])
def test_every_strategy_trains_with_the_one_device_losses(tmp_path, case, strategies):
    """dp, tp (from the model's tp plan), pp, uneven dp and unlike groups with shares: in-process ranks.
    A run trains each strategy on one of the models (`TURNS`)."""
    path, overrides = CASES[case]
    script = load_script(path, parse_overrides([o for o in overrides if not o.startswith("data.")]
                                               + ["data.batch_size=8"]))
    one = run_hspmd(script, tmp_path, steps=2).losses
    for n, strategy in strategies:
        got = run_hspmd(script, tmp_path / strategy.replace(" ", "").replace("|", "_"), steps=2, strategy=strategy,
                        n=n).losses
        assert max(abs(a - b) / abs(b) for a, b in zip(got, one)) <= 1e-4, (strategy, got, one)


@pytest.mark.parametrize("case,expect", [
    ("gpt2", {"transformer.h.[0:2].attn.c_attn.weight": 2, "transformer.h.[0:2].attn.c_attn.bias": 1,
              "transformer.h.[0:2].mlp.c_proj.weight": 1, "transformer.h.[0:2].mlp.c_proj.bias": None}),
    ("llama", {"model.layers.[0:2].self_attn.q_proj.weight": 1, "model.layers.[0:2].self_attn.o_proj.weight": 2,
               "model.layers.[0:2].mlp.down_proj.weight": 2, "model.embed_tokens.weight": 0, "lm_head.weight": 0,
               "model.norm.weight": None}),
])
def test_the_tp_plan_in_pytorch_terms_lays_the_weights_out(case, expect):
    """The example's plan (GPT-2's Conv1D weights are [in, out]) or LLaMA's own `base_model_tp_plan`
    (nn.Linear weights [out, in]): colwise splits the output features, rowwise the input features."""
    from hspmd.dialects import graph
    from hspmd.dialects.dist import layout_of

    path, overrides = CASES[case]
    compiled = compile_script(load_script(path, parse_overrides(overrides)), "[0,1]: tp=2", 2)
    layouts = {o.tensor_name.data: str(layout_of(o.result.type)) for o in compiled.annotated.walk()
               if isinstance(o, graph.ParameterOp)}
    for name, dim in expect.items():
        assert (f"split({dim})=2" in layouts[name]) if dim is not None else "split" not in layouts[name], \
            (name, layouts[name])


def test_repeated_blocks_are_one_function_and_the_ir_is_flat_in_depth():
    """A ModuleList of alike blocks: one function per block type, stacked into one scan; the
    program (every level) is the same at 2 and 48 layers, and only two blocks are exported."""
    from xdsl.dialects import func

    counts = {}
    for layers in (2, 48):
        script = load_script(CASES["gpt2"][0], parse_overrides(CASES["gpt2"][1] + [f"model.layers={layers}"]))
        compiled = compile_script(script, "[0]: dp=1", 1)
        counts[layers] = [sum(1 for _ in getattr(compiled, level).walk()) for level in ("logical", "physical")]
        assert [f.sym_name.data for f in compiled.logical.body.block.ops if isinstance(f, func.FuncOp)] == \
            ["train_step", "GPT2Block_0_bwd", "GPT2Block_0_fwd"]
        imported = hs.from_torch(script.module.torch_model(script.config), next(script.batches()),
                                 script.module.torch_loss).module
        assert [f.sym_name.data for f in imported.body.block.ops if isinstance(f, func.FuncOp)] == \
            ["train_step", "GPT2Block_0"]
        calls = [o for o in imported.walk() if isinstance(o, func.CallOp)]
        assert len(calls) == layers
    assert counts[2] == counts[48]


UNSUPPORTED = '''
import numpy as np
import torch

config = {"steps": 1, "seed": 0}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.nn.functional.avg_pool2d(self.fc(x).reshape(1, 1, 2, 4), 2).pow(2).mean()


def torch_model(config):
    return Net()


def torch_loss(model, batch):
    return model(batch["x"])


def batches(config):
    while True:
        yield {"x": np.ones((2, 4), np.float32)}
'''


def test_an_unsupported_op_is_one_line_naming_it(tmp_path, cli):
    script = tmp_path / "pool.py"
    script.write_text(UNSUPPORTED)
    proc = cli("hspmd", "compile", str(script), timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout
    (line,) = [x for x in proc.stderr.splitlines() if "avg_pool2d" in x]
    assert f"{script}:" in line and "module '(the model)' (Net)" in line and \
        "the ATen op aten.avg_pool2d.default is not supported" in line, line


def test_an_exported_checkpoint_loads_into_the_pytorch_module(tmp_path, cli):
    """Train GPT-2 under tp=2 (tied embedding and head), export the step-2 checkpoint: PyTorch's
    `load_state_dict` takes it as it is, and the loaded module's loss on the third batch is the
    loss hspmd computed at step 3."""
    from safetensors.torch import load_file

    sets = [x for o in CASES["gpt2"][1] + ["optim.warmup=0"] for x in ("--set", o)]
    cli("hspmd", "run", "-n", "2", "examples/hf_gpt2.py", "--strategy", "[0,1]: tp=2", "--steps", "3",
        "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", "--log", str(tmp_path / "log.jsonl"),
        *sets, timeout=300, check=True)
    cli("hspmd", "checkpoint", "export", str(tmp_path / "ck" / "step-2"), "--to", str(tmp_path / "m.safetensors"),
        timeout=120, check=True)
    script = load_script(CASES["gpt2"][0], parse_overrides(CASES["gpt2"][1] + ["optim.warmup=0"]))
    module = script.module.torch_model(script.config)
    state = load_file(str(tmp_path / "m.safetensors"))
    assert set(state) == set(module.state_dict())  # lm_head.weight too, the tied name
    module.load_state_dict(state)
    batches = script.batches()
    next(batches), next(batches)
    loss = script.module.torch_loss(module, torch_batch(next(batches))).item()
    import json

    logged = [json.loads(x)["loss"] for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert abs(logged[2] - loss) / abs(loss) <= 1e-5, (logged, loss)
    # and back: --init-from the file of PyTorch names starts a run from those weights
    cli("hspmd", "run", "-n", "1", "examples/hf_gpt2.py", "--steps", "1", "--init-from", str(tmp_path / "m.safetensors"),
        "--log", str(tmp_path / "again.jsonl"), *sets, timeout=300, check=True)
    first = script.module.torch_loss(module, torch_batch(next(script.batches()))).item()
    again = json.loads((tmp_path / "again.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(again - first) / abs(first) <= 1e-5, (again, first)


def test_the_translators_are_the_ops_aten_facts():
    """Each ATen op the importer translates is claimed by the op it becomes (`ATEN` on the op
    class, `tests/test_op_facts.py`'s table), and each claim has a translator."""
    from hspmd.dialects.context import hspmd_dialects
    from hspmd.dialects.interfaces import aten_names
    from hspmd.frontend import translators

    claimed = {n for d in hspmd_dialects() for op in d.operations for n in aten_names(op)}
    translated = {n for n in translators.TRANSLATORS if n.startswith("aten.")}
    assert claimed == translated, (sorted(claimed - translated), sorted(translated - claimed))
    assert not (translators.IDENTITY | translators.ASSERTS) & translated
