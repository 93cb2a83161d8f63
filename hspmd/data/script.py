"""A model script's data as a dataset: `dataset(config)`, optionally `collate(rows, config)` and
`sampler(config, dataset)`, and the config keys that say how it is batched.

    def dataset(config):                       # in the model script, instead of batches(config)
        return hs.data.TokenDataset(config["data"]["path"]).windows(config["model"]["seq_len"] + 1)

The config's `data` section (`config["data"]`) holds `batch_size` (rows of a global batch,
required), `shuffle` (default true), `drop_last` (default true: an epoch's short last batch is
dropped; false pads it with `pad`), `pad` (each input's padding value; default the dataset's),
`prefetch` (batches a rank makes ahead in a background thread, default 2; 0 reads in the step),
`verify` (default true: before a run trains, its ranks check every shard's CRC-32 between them);
`config["seed"]` seeds the order. Whatever the strategy, global batch k is the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hspmd.data.errors import DataError
from hspmd.data.loader import Loader
from hspmd.data.sampler import Sampler

__all__ = ["DataSettings", "data_settings", "script_dataset", "script_loader", "script_batches", "has_dataset"]


@dataclass(frozen=True)
class DataSettings:
    """How a script's dataset is batched (the module docstring's config keys)."""

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    prefetch: int = 2
    pad: dict | None = None
    verify: bool = True


def _flag(section: dict, key: str, default: bool) -> bool:
    value = section.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise DataError(f"config data.{key}={value!r}: expected true or false")
    return value


def data_settings(config: dict) -> DataSettings:
    """Return the batching settings of `config` (DataError naming the key that is wrong)."""
    section = config.get("data")
    if not isinstance(section, dict) or "batch_size" not in section:
        raise DataError("a script with dataset(config) gives the global batch's rows as config['data']['batch_size']")
    ints = {}
    for key, default, least in (("batch_size", None, 1), ("prefetch", 2, 0)):
        value = section.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise DataError(f"config data.{key}={value!r}: expected an integer of at least {least}")
        ints[key] = value
    seed = config.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DataError(f"config seed={seed!r}: expected a non-negative integer")
    pad = section.get("pad")
    if pad is not None and not isinstance(pad, dict):
        raise DataError(f"config data.pad={pad!r}: expected a dict of each input's padding value")
    return DataSettings(ints["batch_size"], seed, _flag(section, "shuffle", True), _flag(section, "drop_last", True),
                        ints["prefetch"], pad, _flag(section, "verify", True))


def has_dataset(module) -> bool:
    """Return whether a loaded model script gives its data as `dataset(config)`."""
    return callable(getattr(module, "dataset", None))


def _user(call, what: str, where: str):
    """Return `call()`, a function of the user's script; any error but DataError said as one line."""
    try:
        return call()
    except DataError:
        raise
    except Exception as err:
        raise DataError(f"{where}: {what} failed: {type(err).__name__}: {err}") from None


def script_dataset(module, config: dict):
    """Return the script's dataset (its `dataset(config)`), checked to be one."""
    where = getattr(module, "__file__", None) or "the model script"
    ds = _user(lambda: module.dataset(config), "dataset(config)", where)
    if not hasattr(ds, "read") or not hasattr(ds, "__len__"):
        raise DataError(f"{where}: dataset(config) must return a dataset (len() and read(indices), e.g. "
                        f"hs.data.TokenDataset(...).windows(...)), got {type(ds).__name__}")
    return ds


def script_loader(module, config: dict, rows=None, finish=None, prefetch: int | None = None,
                  shapes_only: bool = False) -> Loader:
    """Return the loader of a script's dataset: its sampler (the script's `sampler(config, dataset)`,
    else `Sampler` from the config), its `collate`, its settings; `rows`, `finish`, `prefetch` as
    `Loader` takes them (prefetch default: none, for a caller that reads a batch or two).

    `shapes_only`: the caller needs a batch's shapes and dtypes, not its data (tracing, compiling,
    planning): a dataset with fewer samples than one batch gives a padded batch instead of an error
    (training on it still refuses)."""
    settings = data_settings(config)
    ds = script_dataset(module, config)
    where = getattr(module, "__file__", None) or "the model script"
    if callable(getattr(module, "sampler", None)):
        sampler = _user(lambda: module.sampler(config, ds), "sampler(config, dataset)", where)
    else:
        short = shapes_only and 0 < len(ds) < settings.batch_size
        sampler = Sampler(len(ds), settings.batch_size, settings.seed, settings.shuffle,
                          settings.drop_last and not short)
    collate = None
    if callable(getattr(module, "collate", None)):
        user_collate = module.collate

        def collate(rows):
            return _user(lambda: user_collate(rows, config), "collate(rows, config)", where)

    return Loader(ds, sampler, collate, settings.pad, rows, finish, 0 if prefetch is None else prefetch)


def script_batches(module, config: dict, shapes_only: bool = False) -> Iterator[dict]:
    """Yield a dataset script's global batches, as a `batches(config)` script would give them
    (`shapes_only`: as `script_loader` says)."""
    yield from script_loader(module, config, shapes_only=shapes_only)
