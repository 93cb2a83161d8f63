"""Model scripts: loading a user's script and tracing its training step.

A model script is a Python file that defines:

- `config`: a dict of settings, possibly nested (`{"model": {"layers": 2}, "steps": 200}`).
  `--set KEY=VALUE` on the command line overrides an entry; a dotted KEY walks into nested
  dicts (`--set model.layers=48`). Top-level `steps` (training steps) and `seed` (initial
  values, data order) are read by hspmd itself;
- `model(config)`: returns an `hspmd.nn.Module`;
- `loss(model, batch)`: given the model and a dict of input tensors, returns a scalar loss;
- `dataset(config)`: returns a dataset of `hspmd.data` (`hs.data.TokenDataset(path).windows(T + 1)`,
  docs/data.md), batched by `config["data"]["batch_size"]` in an order that does not depend on the
  strategy; each rank reads only its rows. Optionally `collate(rows, config)` (row by row) and
  `sampler(config, dataset)`. Or, instead:
- `batches(config)`: yields global batches, dicts of NumPy arrays with fixed shapes, the
  same sequence on every call (the runtime gives each rank its piece of each batch);
- optionally `optimizer(config)`: returns an optimizer of `hspmd.optim` (default: plain SGD
  with `config["lr"]`);
- optionally `config["precision"]` ("float32", "bfloat16" or "float16") and
  `config["loss_scale"]`: mixed precision with float32 master weights (see `precision`).

Instead of `model` and `loss`, a script may define `torch_model(config)`, returning a
`torch.nn.Module`, and optionally `torch_loss(module, batch)` (tensors in, a scalar tensor out;
default: the module's own loss) and `tp_plan` (module-name patterns to `colwise`/`rowwise`/
`vocab`, or a function of the config returning them): the loss is imported through
`torch.export` (`hspmd.frontend.torch_import`), and training starts from the module's weights.
`precision` applies to it as PyTorch's `torch.autocast` would (`hspmd.frontend.autocast`).
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import os
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
from xdsl.dialects.builtin import ModuleOp

from hspmd.frontend.nn import Module, bind_parameters
from hspmd.dialects.graph.arithmetic import cast
from hspmd.dialects.traced import REDUCED_PRECISION
from hspmd.frontend.tracing import Tensor, TraceError, Tracer
from hspmd.ir.loss_scaling import DynamicScaling
from hspmd.ir.types import element_type

REQUIRED = ("config", "model", "loss", "batches")
#: what a script importing a PyTorch model defines instead (`torch_loss` optional)
REQUIRED_TORCH = ("config", "torch_model", "batches")
#: a script may give `dataset` (hspmd.data) where these lists say `batches`
DATA_ALTERNATIVE = {"batches": "dataset"}


class ScriptError(Exception):
    """A model script is missing, broken, or lacks part of the contract."""


@dataclass
class ModelScript:
    """A loaded model script and its (overridden) config."""

    path: str
    module: ModuleType
    config: dict = field(default_factory=dict)
    #: after `trace_script` of a script with `torch_model`: the imported program (its weights, aliases)
    imported: object = None

    @property
    def is_torch(self) -> bool:
        """Return whether the script imports a PyTorch model (`torch_model`)."""
        return hasattr(self.module, "torch_model")

    def batches(self, shapes_only: bool = False):
        """Return an iterator over the script's global batches (its `batches(config)`, or its
        `dataset(config)` read in the sampler's order). `shapes_only`: for a caller that needs a
        batch's shapes and dtypes only (tracing): a dataset smaller than one batch gives a padded
        batch rather than an error."""
        from hspmd.data.errors import DataError
        from hspmd.data.script import has_dataset, script_batches

        if not has_dataset(self.module):
            return iter(self.module.batches(self.config))

        def read():
            try:
                yield from script_batches(self.module, self.config, shapes_only)
            except DataError as err:
                raise ScriptError(str(err)) from None

        return read()


def parse_overrides(items: list[str] | None) -> dict:
    """Return {key: value} from `KEY=VALUE` strings (values parsed as Python literals if they can be)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ScriptError(f"--set {item!r}: expected KEY=VALUE")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key.strip()] = raw
    return out


def load_script(path: str, overrides: dict | None = None) -> ModelScript:
    """Return the model script at `path`, its config updated by `overrides`."""
    if not os.path.isfile(path):
        raise ScriptError(f"{path}: no such model script")
    name = "hspmd_script_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's code: report it as a script error, with its line
        import traceback

        tb = traceback.extract_tb(err.__traceback__)
        where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb) if f.filename == path), path)
        raise ScriptError(f"{where}: loading the script failed: {type(err).__name__}: {err}") from None
    required = REQUIRED_TORCH if hasattr(module, "torch_model") else REQUIRED
    missing = [n for n in required if not hasattr(module, n) and not hasattr(module, DATA_ALTERNATIVE.get(n, n))]
    if missing and required is REQUIRED_TORCH:
        raise ScriptError(f"{path}: a model script with torch_model must define {', '.join(REQUIRED_TORCH)}; "
                          f"missing {', '.join(missing)}")
    if missing:
        raise ScriptError(f"{path}: a model script must define {', '.join(REQUIRED)} (or dataset instead of batches); "
                          f"missing {', '.join(missing)}")
    config = copy.deepcopy(dict(module.config))
    for key, value in (overrides or {}).items():
        set_config(config, key, value)
    return ModelScript(os.path.abspath(path), module, config)


#: the config keys of dynamic loss scaling's settings, and the DynamicScaling field each sets
DYNAMIC_SCALE_KEYS = {
    "loss_scale_init": "init_scale",
    "loss_scale_growth_factor": "growth_factor",
    "loss_scale_backoff_factor": "backoff_factor",
    "loss_scale_growth_interval": "growth_interval",
}


#: top-level config keys `--set` takes even where a script does not declare them
OPTIONAL_KEYS = ("tf32", "flash_attention", "loss_scale", *DYNAMIC_SCALE_KEYS)


def set_config(config: dict, key: str, value) -> None:
    """Set the (dotted) `key` of a nested config dict; ScriptError if the key does not exist."""
    *path, last = key.split(".")
    node = config
    for i, part in enumerate(path):
        if not isinstance(node.get(part), dict):
            raise ScriptError(f"--set {key}: the script's config has no section '{'.'.join(path[: i + 1])}'")
        node = node[part]
    if last not in node and not path and last in OPTIONAL_KEYS:
        node[last] = value  # a key every script takes, declared or not
        return
    if last not in node:
        where = f"section '{'.'.join(path)}'" if path else "config"
        raise ScriptError(f"--set {key}: the script's {where} has no key '{last}' (keys: {', '.join(sorted(node))})")
    old = node[last]
    if isinstance(old, dict):
        raise ScriptError(f"--set {key}: '{key}' is a section; set one of its keys ({', '.join(sorted(old))})")
    if isinstance(old, (int, float)) and not isinstance(old, bool) and isinstance(value, str) and (
        key, value) != ("loss_scale", "dynamic"):
        raise ScriptError(f"--set {key}={value}: expected a number")
    node[last] = value


def script_optimizer(script: ModelScript):
    """Return the script's `optimizer(config)`, or plain SGD with `config["lr"]` (0.01 if absent)."""
    from hspmd.frontend.optim import SGD, Optimizer

    make = getattr(script.module, "optimizer", None)
    if make is None:
        return SGD(float(script.config.get("lr", 0.01)))
    try:
        opt = make(script.config)
    except Exception as err:  # the user's code (a bad argument raises ValueError with the reason)
        raise ScriptError(f"{script.path}: optimizer(config) failed: {type(err).__name__}: {err}") from None
    if not isinstance(opt, Optimizer):
        raise ScriptError(
            f"{script.path}: optimizer(config) must return an hspmd.optim optimizer (SGD, Adam, AdamW), "
            f"got {type(opt).__name__}"
        )
    return opt


def user_call(script: ModelScript, what: str, fn, *args):
    """Return `fn(*args)`, a function of the user's script; an exception it raises becomes one
    ScriptError naming the script's innermost line in the traceback, `what` and the exception
    (hspmd's own checks of a config, called from the script, included). StopIteration passes."""
    try:
        return fn(*args)
    except (ScriptError, TraceError, StopIteration):
        raise
    except Exception as err:  # noqa: BLE001 - the user's code: its line and its message
        import traceback

        tb = traceback.extract_tb(err.__traceback__)
        where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb)
                      if os.path.abspath(f.filename) == os.path.abspath(script.path)), script.path)
        raise ScriptError(f"{where}: {what} failed: {type(err).__name__}: {err}") from None


def trace_script(script: ModelScript) -> ModuleOp:
    """Return the logical IR of the script's forward step: parameters, inputs, `graph.output "loss"`."""
    try:
        first = user_call(script, "batches(config)", lambda: next(script.batches(shapes_only=True)))
    except StopIteration:
        raise ScriptError(f"{script.path}: batches(config) yields no batch") from None
    if script.is_torch:
        return trace_torch_script(script, first)
    model = user_call(script, "model(config)", script.module.model, script.config)
    if not isinstance(model, Module):
        raise ScriptError(f"{script.path}: model(config) must return an hspmd.nn.Module, got {type(model).__name__}")
    compute = precision(script)
    tracer = Tracer()
    with bind_parameters(model, tracer, compute):
        inputs = {
            name: tracer.input(name, np.shape(value), np.asarray(value).dtype.name) for name, value in first.items()
        }
        if compute:  # float inputs enter the model in the compute dtype
            inputs = {k: cast(v, compute) if v.dtype.startswith("float") else v for k, v in inputs.items()}
        try:
            loss = script.module.loss(model, inputs)
        except TraceError:
            raise
        except Exception as err:
            import traceback

            tb = traceback.extract_tb(err.__traceback__)
            where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb) if f.filename == script.path), script.path)
            raise TraceError(f"{where}: tracing failed: {type(err).__name__}: {err}") from None
        if not isinstance(loss, Tensor) or loss.shape != ():
            raise TraceError(f"{script.path}: loss(model, batch) must return a scalar tensor, got {loss!r}")
        if loss.dtype != "float32" and loss.dtype in REDUCED_PRECISION:
            loss = cast(loss, "float32")
        tracer.output("loss", loss)
    return tracer.finish()


def trace_torch_script(script: ModelScript, first: dict) -> ModuleOp:
    """Return the logical IR of a script's PyTorch model (`torch_model`, `torch_loss`, `tp_plan`),
    imported through `torch.export` (with `precision`, computing as under `torch.autocast`); the
    imported program (weights, aliases, a transformers model's config) is kept on the script."""
    from hspmd.frontend.torch_import import from_torch

    compute = precision(script)
    module = user_call(script, "torch_model(config)", script.module.torch_model, script.config)
    plan = getattr(script.module, "tp_plan", None)
    if callable(plan):
        plan = plan(script.config)
    program = from_torch(module, first, getattr(script.module, "torch_loss", None), plan, precision=compute)
    script.imported = program
    return program.module


def precision(script: ModelScript) -> str | None:
    """Return the compute dtype the config asks for (`precision`: float16 or bfloat16), or None.

    Parameters stay float32 master weights; the forward and backward compute in the reduced
    dtype, with softmax, norms and the loss in float32. `loss_scale` (default 1024 for float16,
    1 otherwise) multiplies the loss before the backward and divides the gradients after;
    `loss_scale="dynamic"` makes it PyTorch's GradScaler (see `loss_scale`).
    """
    value = script.config.get("precision", "float32")
    if value in (None, "float32"):
        return None
    if value not in REDUCED_PRECISION:
        raise ScriptError(f"config precision={value!r}: expected float32, bfloat16 or float16")
    try:
        element_type(value)
    except TypeError as err:
        raise ScriptError(f"config precision={value!r}: {err} (bfloat16 needs the ml_dtypes package)") from None
    return value


def config_flag(config: dict, key: str, default: bool) -> bool:
    """Return the config's true/false switch `key` (a bool, or "true"/"false" as `--set` gives
    it; `default` where absent); ScriptError for anything else."""
    value = config.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ScriptError(f"config {key}={value!r}: expected true or false")
    return value


def tf32(config: dict) -> bool:
    """Return whether the config asks for float32 products on TF32 tensor cores (`tf32`: true or
    false, default false; a GPU run's GEMMs only: the CPU has no TF32 and ignores it)."""
    return config_flag(config, "tf32", False)


def flash_attention(config: dict) -> bool:
    """Return whether a GPU program fuses attention into flash-style kernels (`flash_attention`:
    true or false, default true; `--set flash_attention=false` compares with the unfused kernels)."""
    return config_flag(config, "flash_attention", True)


def loss_scale(script: ModelScript) -> float | DynamicScaling:
    """Return the loss scale of the script's config (see `precision`): a static scale (a
    positive number; default 1024 for float16, else 1), or with `loss_scale="dynamic"` the
    settings of dynamic loss scaling (PyTorch's GradScaler; its defaults, or the config's
    `loss_scale_init`, `loss_scale_growth_factor`, `loss_scale_backoff_factor`,
    `loss_scale_growth_interval`). ScriptError for anything else."""
    value = script.config.get("loss_scale")
    given = {key: script.config[key] for key in DYNAMIC_SCALE_KEYS if script.config.get(key) is not None}
    if value == "dynamic":
        for key, setting in given.items():
            if isinstance(setting, bool) or not isinstance(setting, (int, float)):
                raise ScriptError(f"config {key}={setting!r}: expected a number")
            if key == "loss_scale_growth_interval" and isinstance(setting, float) and setting.is_integer():
                given[key] = int(setting)
        try:
            return DynamicScaling(**{DYNAMIC_SCALE_KEYS[k]: v for k, v in given.items()})
        except ValueError as err:
            key = next(k for k, f in DYNAMIC_SCALE_KEYS.items() if str(err).startswith(f + "="))
            raise ScriptError(f"config {key}{str(err)[len(DYNAMIC_SCALE_KEYS[key]):]}") from None
    if given:
        raise ScriptError(f"config {next(iter(given))}: applies to loss_scale='dynamic' only, "
                          f"and loss_scale is {value!r}")
    default = 1024.0 if script.config.get("precision") == "float16" else 1.0
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < float("inf")):
        raise ScriptError(f"config loss_scale={value!r}: expected a positive number or 'dynamic'")
    return float(value)
