"""Encoders and heads of transformers, and encoder-decoders: BERT, RoBERTa and DistilBERT with a
masked-LM head and with a sequence-classification head, on batches padded to a common length (an
`attention_mask` from the batch, masked-LM labels of -100), and T5 and BART trained on their own
seq2seq loss: the imported program's loss and every gradient equal PyTorch's. Each run checks
two of the six encoder cases and one of the two encoder-decoders, chosen by the run's seed
(`HSPMD_TEST_SEED`, printed in pytest's header).

The scripts are `tests/torch_scripts/encoder_model.py` and `seq2seq_model.py`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import ROOT, sampled

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[torch]')")

from hspmd.frontend.script import load_script  # noqa: E402
from torch_zoo import _run, rel  # noqa: E402

SCRIPTS = os.path.join(ROOT, "tests", "torch_scripts")
CASES = {f"{a}-{h}": ("encoder_model.py", {"arch": a, "head": h})
         for a in ("bert", "roberta", "distilbert") for h in ("mlm", "classify")}
CASES.update({s: ("seq2seq_model.py", {"arch": s}) for s in ("t5", "bart")})
#: two encoder cases and one encoder-decoder per run (the run's seed: `HSPMD_TEST_SEED`)
SAMPLE = sampled([c for c in CASES if "-" in c], 2, "encoders") + sampled([c for c in CASES if "-" not in c], 1, "seq2seq")


@pytest.mark.parametrize("case", SAMPLE)
def test_the_loss_and_every_gradient_equal_pytorchs(tmp_path, case):
    name, overrides = CASES[case]
    script = load_script(os.path.join(SCRIPTS, name), overrides)
    first = _run(script, str(tmp_path / "b"), "[0]: dp=1", 1, 1, False)
    model = script.module.torch_model(script.config)
    batch = {k: torch.as_tensor(v) for k, v in next(script.batches()).items()}
    loss = script.module.torch_loss(model, batch)
    loss.backward()
    assert rel(first.losses[0], loss.item()) <= 1e-5
    for pname, p in model.named_parameters():
        ours = first.outputs[0].get(f"grad:{pname}")
        if p.grad is None or np.abs(p.grad.numpy()).max() < 1e-9:  # unused, or a key bias: zero but rounding
            assert ours is None or np.abs(ours).max() < 1e-9, pname
        else:
            assert rel(ours, p.grad.numpy()) <= 1e-5, pname


def test_a_padded_batch_split_over_two_ranks_gives_the_one_device_losses(tmp_path):
    """The padding mask travels with its rows: dp=2 equals one device (masked LM, two AdamW steps)."""
    script = load_script(os.path.join(SCRIPTS, "encoder_model.py"), {"arch": "roberta", "head": "mlm"})
    one = _run(script, str(tmp_path / "one"), "[0]: dp=1", 1, 2, True).losses
    two = _run(script, str(tmp_path / "two"), "[0,1]: dp=2", 2, 2, True).losses
    assert max(abs(a - b) / abs(b) for a, b in zip(two, one)) <= 1e-5, (one, two)
