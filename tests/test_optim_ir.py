"""The optim dialect's verifiers, the optimizer passes' errors, hs.optim, and a whole run from a script.

The end-to-end test writes a model script that defines `optimizer(config)` (AdamW, clipping,
warm-up + cosine), compiles it into a bundle, trains it with the worker on 2 in-process ranks
and checks the checkpoint: parameters as the NumPy reference of test_optim computes them, and
the optimizer state (opt.m.*, opt.v.*, opt.step, the beta powers) beside them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hspmd.compiler import compile_script, default_strategy, write_bundle
from hspmd.frontend.optim import SGD, Adam, AdamW, WarmupCosine, pass_float
from hspmd.frontend.script import ScriptError, load_script
from hspmd.dialects.context import IRTextError, parse_module
from hspmd.runtime.checkpoint import load_checkpoint
from hspmd.runtime.comm import run_spmd
from hspmd.dialects.optim import adam, sgd
from hspmd.ir.lr_schedule import schedule_from_spec
from hspmd.runtime.worker import train
from hspmd.compiler import run_passes
from hspmd.transforms import build_passes
from hspmd.transforms.util import PassError
from test_optim import BATCHES, CLIP, reference

GRADS = """
builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "zeros"} : tensor<4x3xf32>
    %l = graph.constant {value = 0.0 : f64} : tensor<f32>
    graph.output "loss", %l : tensor<f32>
    %gw = graph.constant {value = 1.0 : f64} : tensor<4x3xf32>
    graph.output "grad:w", %gw : tensor<4x3xf32>
    func.return
  }
}
"""


def _op_module(body: str, args: str) -> str:
    return f"builtin.module {{\n  func.func @f({args}) {{\n    {body}\n    func.return\n  }}\n}}\n"


ARGS = "%p: tensor<4xf32>, %g: tensor<4xf32>, %b: tensor<4xf32>, %lr: tensor<f64>, %q: tensor<3xf32>"


@pytest.mark.parametrize(
    "body,message",
    [
        # momentum without a buffer
        ("%0 = optim.sgd %p, %g, %lr {momentum = 0.9 : f64, weight_decay = 0.0 : f64, nesterov = false}"
         " : (tensor<4xf32>, tensor<4xf32>, tensor<f64>) -> tensor<4xf32>", "exactly when momentum"),
        ("%0 = optim.sgd %p, %g, %lr {momentum = 0.0 : f64, weight_decay = 0.0 : f64, nesterov = true}"
         " : (tensor<4xf32>, tensor<4xf32>, tensor<f64>) -> tensor<4xf32>", "nesterov needs a momentum"),
        ("%0 = optim.sgd %p, %q, %lr {momentum = 0.0 : f64, weight_decay = 0.0 : f64, nesterov = false}"
         " : (tensor<4xf32>, tensor<3xf32>, tensor<f64>) -> tensor<4xf32>", "gradient has type"),
        ("%0 = optim.sgd %p, %g, %g {momentum = 0.0 : f64, weight_decay = 0.0 : f64, nesterov = false}"
         " : (tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) -> tensor<4xf32>", "lr must be a 0-d tensor"),
        ("%0, %1, %2 = optim.adam %p, %g, %b, %b, %lr, %lr, %lr {beta1 = 1.0 : f64, beta2 = 0.999 : f64,"
         " eps = 1.0e-08 : f64, weight_decay = 0.0 : f64, decoupled = false} : (tensor<4xf32>, tensor<4xf32>,"
         " tensor<4xf32>, tensor<4xf32>, tensor<f64>, tensor<f64>, tensor<f64>) -> (tensor<4xf32>, tensor<4xf32>,"
         " tensor<4xf32>)", "beta1 = 1.0 must be in"),
        ("%0 = optim.sum_squares %p : (tensor<4xf32>) -> tensor<4xf32>", "0-d tensor"),
        ("%0 = optim.clip_coef %lr {max_norm = 0.0 : f64} : (tensor<f64>) -> tensor<f64>", "max_norm = 0.0 must be > 0"),
    ],
)
def test_verifiers_reject_malformed_ops(body, message):
    with pytest.raises(IRTextError, match=message):
        parse_module(_op_module(body, ARGS))


def test_ops_print_and_parse_back():
    module = parse_module(GRADS)
    run_passes(module, "clip-grad-norm{max_norm=1.0},adam{lr_input=true}")
    text = str(module)
    assert str(parse_module(text)) == text


@pytest.mark.parametrize(
    "spec,message",
    [
        ("adam", "no gradient outputs; run 'autodiff' first"),
        ("sgd", "no gradient outputs"),
        ("clip-grad-norm", "no gradient outputs"),
    ],
)
def test_passes_need_gradients(spec, message):
    module = parse_module(GRADS.replace('graph.output "grad:w", %gw : tensor<4x3xf32>', ""))
    with pytest.raises(PassError, match=message):
        run_passes(module, spec)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("adam{beta1=1.0}", r"beta1=1.0 must be >= 0.0 and < 1.0"),
        ("adam{eps=-1.0}", "eps"),
        ("sgd{nesterov=true}", "nesterov=true needs a momentum"),
        ("sgd{lr=-0.5}", "lr=-0.5"),
        ("clip-grad-norm{max_norm=0.0}", "max_norm=0.0 must be > 0.0"),
        ("sgd,adam", "no gradient outputs"),  # the first optimizer consumed them
    ],
)
def test_passes_reject_bad_options(spec, message):
    with pytest.raises(PassError, match=message):
        run_passes(parse_module(GRADS), spec)


def test_lr_input_reuses_a_scalar_lr_input_and_rejects_another():
    module = parse_module(GRADS)
    run_passes(module, "clip-grad-norm,sgd{lr_input=true}")
    assert str(module).count('graph.input "lr"') == 1
    clash = GRADS.replace('%l = graph.constant', '%lr = graph.input "lr" : tensor<4xf32>\n    %l = graph.constant')
    with pytest.raises(PassError, match="lr_input needs 'lr' to be a tensor<f64> input"):
        run_passes(parse_module(clash), "adam{lr_input=true}")
    taken = GRADS.replace('%l = graph.constant', '%m = graph.parameter "opt.m.w" {init = "zeros"} : tensor<4x3xf32>\n    %l = graph.constant')
    with pytest.raises(PassError, match="already has a parameter or input named 'opt.m.w'"):
        run_passes(parse_module(taken), "adam")


def test_kernels_keep_float32_with_float64_scalars():
    p, g = np.ones(3, np.float32), np.full(3, 0.5, np.float32)
    new_p, m, v = adam(p, g, np.zeros(3, np.float32), np.zeros(3, np.float32), 0.1, 0.1, 0.001, 0.9, 0.999, 1e-8, 0.01, True)
    assert new_p.dtype == m.dtype == v.dtype == np.float32
    # the first Adam step moves every weight by about lr (m_hat / sqrt(v_hat) = sign(g)), after decay
    np.testing.assert_allclose(new_p, 1 * (1 - 0.1 * 0.01) - 0.1, rtol=1e-6)
    p1, buf = sgd(p, g, np.zeros(3, np.float32), 0.1, 0.9, 0.0, True)
    assert p1.dtype == buf.dtype == np.float32
    np.testing.assert_allclose(p1, 1 - 0.1 * (0.5 + 0.9 * 0.5), rtol=1e-6)


def test_frontend_pipelines_parse_into_the_passes():
    opt = AdamW(1e-3, betas=(0.9, 0.95), clip_grad_norm=1.0, schedule=WarmupCosine(10, 100))
    clip, update = build_passes(opt.pipeline())
    assert (clip.name, clip.max_norm) == ("clip-grad-norm", 1.0)
    assert (update.name, update.beta2, update.weight_decay, update.decoupled, update.lr_input) == ("adam", 0.95, 0.01, True, True)
    (plain,) = build_passes(Adam(1e-5).pipeline())
    assert (plain.lr, plain.decoupled, plain.lr_input, plain.eps) == (1e-5, False, False, 1e-8)
    (s,) = build_passes(SGD(0.1, 0.9, 1e-4, True).pipeline())
    assert (s.lr, s.momentum, s.weight_decay, s.nesterov) == (0.1, 0.9, 1e-4, True)
    assert SGD(0.1, clip_grad_norm=0.0).pipeline().startswith("sgd")  # 0: no clipping
    assert [pass_float(x) for x in (1e-8, 3.0, 2.5e-05, 1e20)] == ["1.0e-08", "3.0", "2.5e-05", "1.0e+20"]


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: SGD(0.1, nesterov=True), "Nesterov"),
        (lambda: SGD(-1.0), "lr must be >= 0"),
        (lambda: Adam(1e-3, betas=(0.9, 1.0)), "betas"),
        (lambda: AdamW(1e-3, clip_grad_norm=-1.0), "clip_grad_norm"),
        (lambda: AdamW(1e-3, schedule="cosine"), "schedule must be"),
    ],
)
def test_frontend_rejects_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


SCRIPT = '''
import numpy as np
import hspmd as hs

config = {"lr": 0.05, "steps": 5, "seed": 3, "clip": %(clip)r}


class MLP(hs.nn.Module):
    def __init__(self):
        init = "uniform:-0.6:0.6"
        self.w1 = hs.nn.Parameter((5, 6), init, "float64")
        self.b1 = hs.nn.Parameter((6,), init, "float64")
        self.w2 = hs.nn.Parameter((6, 3), init, "float64")
        self.b2 = hs.nn.Parameter((3,), init, "float64")

    def forward(self, x):
        return hs.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2


def model(config):
    return MLP()


def loss(model, batch):
    return hs.cross_entropy(model(batch["x"]), batch["y"])


def optimizer(config):
    %(optimizer)s


def batches(config):
    rng = np.random.default_rng(11)
    while True:
        yield {"x": rng.standard_normal((8, 5)), "y": rng.integers(0, 3, 8).astype(np.int64)}
'''

ADAMW = ("return hs.optim.AdamW(config['lr'], weight_decay=0.1, clip_grad_norm=config['clip'],"
         " schedule=hs.optim.WarmupCosine(2, config['steps'], min_lr=0.005))")


def _script(tmp_path, optimizer: str = ADAMW, clip=CLIP):
    path = tmp_path / "mlp64.py"
    path.write_text(SCRIPT % {"clip": clip, "optimizer": optimizer})
    return load_script(str(path))


@pytest.mark.parametrize("n", [1, 2])
def test_script_optimizer_trains_and_checkpoints_its_state(tmp_path, n):
    script = _script(tmp_path)
    assert np.allclose(next(script.batches())["x"], BATCHES[0]["x"])  # the data of test_optim
    bundle = tmp_path / f"bundle{n}"
    write_bundle(compile_script(script, default_strategy(n), n), str(bundle))
    spec = json.loads((bundle / "manifest.json").read_text())["config"]["lr_schedule"]
    assert spec == {"kind": "warmup_cosine", "peak": 0.05, "warmup_steps": 2, "total_steps": 5, "min_lr": 0.005}
    ck, log = tmp_path / "ck.npz", tmp_path / "log.jsonl"
    results = run_spmd(n, lambda comm: train(str(bundle), comm, checkpoint=str(ck), log=str(log), quiet=True))
    schedule = schedule_from_spec(spec)
    assert results[0].lrs == [schedule(s) for s in range(1, 6)]
    assert [json.loads(line)["lr"] for line in log.read_text().splitlines()] == results[0].lrs

    params, step = load_checkpoint(str(ck))
    assert step == 5
    want = reference(script.module.optimizer(script.config))[0][-1]
    names = {"w1", "b1", "w2", "b2"}
    assert {f"opt.{kind}.{k}" for kind in "mv" for k in names} <= params.keys()
    assert int(params["opt.step"]) == 5
    assert float(params["opt.beta1_pow"]) == pytest.approx(0.9**5, rel=1e-14)
    for name, value in want.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_scripts_without_optimizer_keep_plain_sgd_and_bad_ones_fail_clearly(tmp_path):
    script = _script(tmp_path, "return None")
    with pytest.raises(ScriptError, match="must return an hspmd.optim optimizer"):
        compile_script(script, "[0]: dp=1", 1)
    script = _script(tmp_path, "return hs.optim.SGD(config['lr'], nesterov=True)")
    with pytest.raises(ScriptError, match="optimizer\\(config\\) failed: ValueError: Nesterov"):
        compile_script(script, "[0]: dp=1", 1)
    del script.module.optimizer
    compiled = compile_script(script, "[0]: dp=1", 1)
    assert compiled.lr_schedule == {"kind": "constant", "lr": 0.05}
    text = str(compiled.logical)
    assert "optim.sgd" in text and 'graph.input "lr"' not in text and "opt.m." not in text
    grads_only = compile_script(script, "[0]: dp=1", 1, optimizer=False)
    assert compiled.lr_schedule and grads_only.lr_schedule is None
    assert 'graph.output "grad:w1"' in str(grads_only.logical) and "optim." not in str(grads_only.logical)
