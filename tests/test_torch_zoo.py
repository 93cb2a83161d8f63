"""The zoo: transformers' causal LMs, each built from a small config (`tests/torch_zoo.py`),
imported and checked against PyTorch: the step-1 loss (1e-5), every gradient (1e-4), the loss
after one AdamW step (1e-4) and, where the model defines a tp plan, tp=2 against one device.

The whole mapping (about 200 entries) is too long for CI, so each run samples: one
architecture of those the importer must take (the decoders issue 39 names, each of which once
stopped at one op or already matched), with an AdamW step and tp=2; one entry of the whole
mapping (`tests/zoo_table.json`, the table as last run), which must import with PyTorch's loss and
gradients (where it did) or be refused in one line (never import with other numbers); one
expert layer (Mixtral's or Qwen-MoE's) under ep=2; one entry that imported, under
`precision=bfloat16`, its step-1 loss within 1e-2 of PyTorch's under `torch.autocast`; and one
deeper entry whose layers the export keeps in part, with PyTorch's loss and gradients. The
seed varies from run to run (`HSPMD_TEST_SEED` fixes it; pytest's header prints it).
`python tests/torch_zoo.py [ARCH ...]` prints the table (`docs/torch-import.md` holds one).
"""

from __future__ import annotations

import pytest

from conftest import sampled

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[torch]')")

import torch_zoo  # noqa: E402

from hspmd.compiler import compile_script, write_bundle  # noqa: E402
from hspmd.frontend.script import load_script  # noqa: E402
from hspmd.runtime.comm import run_spmd  # noqa: E402
from hspmd.runtime.worker import train  # noqa: E402

#: decoder-only architectures that import and equal PyTorch (tp=2 too, where they have a plan)
MUST_IMPORT = ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen3", "phi", "gemma", "gemma2", "stablelm",
               "gpt_bigcode", "olmo", "gpt_neox", "gptj", "codegen", "phi3", "bloom", "falcon", "mixtral")
#: transformers' mixture-of-experts decoders (Mixtral-style and Qwen-MoE-style routing)
MOE = ("mixtral", "qwen2_moe")
#: this run's sample (the seed: `HSPMD_TEST_SEED`, printed in pytest's header; the test ids name them)
NAMED = sampled(MUST_IMPORT, 1, "zoo-named")
#: the zoo's table as last run over the whole mapping (`tests/zoo_table.json`, one row per entry:
#: `python tests/torch_zoo.py --json FILE` makes rows; `docs/torch-import.md` shows the table): CI
#: samples the entries whose rows took at most a minute; an entry that imported must still import
ROWS = {r["arch"]: r for r in torch_zoo.recorded_rows()}
OTHER = sampled(sorted(a for a, r in ROWS.items() if a in torch_zoo.zoo() and r["status"] in ("imported", "refused")
                       and (r.get("seconds") or 999) <= 60), 1, "zoo-other")
MOE_ARCH = sampled(MOE, 1, "zoo-moe")
#: deeper entries whose layers the importer exports in part (`hspmd.frontend.torch_repeats`), at a depth
#: where blocks are left out: a dense first layer (compared eagerly), per-layer inputs (Gemma-4),
#: top-k indices handed on through shared layers (HY-v4), per-layer numbers (DiffLlama), two kinds
DEEP = sampled(("gemma4_text:12", "hy_v4:8", "deepseek_v3:6", "exaone_moe:9", "diffllama:6", "gemma3_text:8"), 1,
               "zoo-deep")
#: an entry that imported, under `precision=bfloat16`
BF16 = sampled(sorted(a for a, r in ROWS.items() if a in torch_zoo.zoo() and r["status"] == "imported"
                      and (r.get("seconds") or 999) <= 60), 1, "zoo-bf16")


@pytest.mark.parametrize("arch", NAMED)
def test_a_named_architecture_imports_and_equals_pytorch_under_tp(tmp_path, arch):
    row = torch_zoo.check(arch, str(tmp_path))
    print(torch_zoo.table([row]))
    assert row["status"] == "imported", row
    assert row["loss"] <= 1e-5 and row["grad"] <= 1e-4 and row["adamw"] <= 1e-4, row
    if torch_zoo.first_plan(torch_zoo.build(arch)[0]):
        assert row["tp"] is not None and row["tp"] <= 1e-4, row


@pytest.mark.parametrize("arch", OTHER)
def test_an_entry_of_the_mapping_imports_with_pytorchs_numbers_or_is_refused_in_one_line(tmp_path, arch):
    row = torch_zoo.check(arch, str(tmp_path), tp=False, adamw=False)
    print(torch_zoo.table([row]))
    if ROWS[arch]["status"] == "imported":  # as recorded: never back to a refusal or other numbers
        assert row["status"] == "imported", row
    assert row["status"] in ("imported", "refused", "not in zoo"), row
    if row["status"] != "imported":
        assert row["reason"] and "\n" not in row["reason"] and "Traceback" not in row["reason"], row


@pytest.mark.parametrize("arch", MOE_ARCH)
def test_an_imported_expert_layer_splits_its_experts_under_ep(tmp_path, arch):
    """transformers' expert layer is exported through hspmd's MoE ops (dropless): under
    `[0,1]: ep=2` the experts split and the tokens move by all-to-all, with one device's losses."""
    script = load_script(torch_zoo.ZOO_SCRIPT, {"arch": arch})
    losses = {}
    for n, strategy in ((1, "[0]: dp=1"), (2, "[0,1]: ep=2")):
        compiled = compile_script(script, strategy, n)
        if n == 2:
            assert any(o.name == "comm.all_to_all" for o in compiled.physical.walk())
        write_bundle(compiled, str(tmp_path / str(n)))
        losses[n] = run_spmd(n, lambda comm, b=str(tmp_path / str(n)): train(b, comm, steps=2, quiet=True))[0].losses
    assert max(abs(a - b) / abs(b) for a, b in zip(losses[2], losses[1])) <= 1e-5, losses


def test_gradients_agree_within_1e4_or_as_close_to_float64_as_pytorchs():
    row = {"grad": 3e-5}
    assert torch_zoo.grads_agree(row)
    assert not torch_zoo.grads_agree({"grad": 2e-4})  # no float64 reference: other numbers
    assert torch_zoo.grads_agree({"grad": 2e-4, "grad64": [1.2e-4, 1.2e-4]})  # PyTorch's own float32 rounding
    assert not torch_zoo.grads_agree({"grad": 2e-4, "grad64": [5e-4, 1e-5]})  # PyTorch close to exact, hspmd not


@pytest.mark.parametrize("arch", BF16)
def test_an_imported_entry_computes_in_bfloat16_as_torch_autocast(arch):
    import numpy as np

    import hspmd as hs
    from conftest import run_imported

    model, batch = torch_zoo.build(arch)[0], torch_zoo.batch(0)
    program = hs.from_torch(model, batch, torch_zoo.loss, precision="bfloat16")
    ours = float(run_imported(program, batch)["loss"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = torch_zoo.loss(model, {k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}).item()
    assert abs(ours / theirs - 1) <= 1e-2, (ours, theirs)


@pytest.mark.parametrize("spec", DEEP)
def test_a_deeper_entry_exported_in_part_has_pytorchs_numbers(tmp_path, spec):
    """The blocks left out of the export compute as PyTorch's: each takes the values the blocks
    before it hand on and its own inputs (silently its template's once, for Gemma-4)."""
    import hspmd as hs

    arch, layers = spec.split(":")
    model = torch_zoo.build(arch, layers=int(layers))[0]
    program = hs.from_torch(model, torch_zoo.batch(0), torch_zoo.loss)
    assert program.repeated and all(p.exported < p.length for p in program.repeated.values()), program.repeated
    row = torch_zoo.check(arch, str(tmp_path), tp=False, adamw=False, layers=int(layers))
    assert row["status"] == "imported" and row["loss"] <= 1e-5 and torch_zoo.grads_agree(row), row
