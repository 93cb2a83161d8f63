"""Training on a prepared dataset (examples/gpt.py --set data.path=DIR): every strategy gives the
losses of one device while each rank reads only its rows; a resume with another device count
continues with the same batches, from the sampler state in the checkpoint, without a replay; bad
shards stop a run before it trains. In-process ranks (`run_spmd`); the mpiexec path is the
acceptance script's."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import EXAMPLES
from hspmd.compiler import compile_script, write_bundle
from hspmd.data.prepare import prepare
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.runtime.checkpoint.manifest import read_manifest
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.data.feed import open_feed
from hspmd.runtime.worker import CheckpointOptions, RunError, load_script_module, train

GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=8",
         "optim.warmup=2", "steps=8"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from pydoc_data.topics import topics

    where = tmp_path_factory.mktemp("data")
    files = []
    for i, key in enumerate(sorted(topics)[:6]):
        files.append(str(where / f"{i}.txt"))
        open(files[-1], "w").write(topics[key])
    out = str(where / "ds")
    prepare(files, "byte", out, shard_bytes=4096, jobs=2, progress=False)
    return out


def _bundle(tmp_path, dataset: str, strategy: str, n: int, extra: tuple[str, ...] = ()) -> str:
    path = tmp_path / ("b-" + "".join(c for c in strategy + "".join(extra) if c.isalnum()))
    script = load_script(GPT, parse_overrides(SMALL + [f"data.path={dataset}", *extra]))
    write_bundle(compile_script(script, strategy, n), str(path))
    return str(path)


def _losses(bundle: str, n: int, steps: int = 8, **options) -> list[float]:
    results = run_spmd(n, lambda comm: train(bundle, comm, steps=steps, quiet=True,
                                             checkpoints=CheckpointOptions(**options)), timeout=300)
    return results[0].losses


@pytest.fixture(scope="module")
def one_device(dataset, tmp_path_factory):
    return _losses(_bundle(tmp_path_factory.mktemp("one"), dataset, "[0]: dp=1", 1), 1)


@pytest.mark.parametrize("strategy,n", [
    ("[0,1]: dp=2", 2),
    ("[0,1]: tp=2", 2),
    ("[0,1]: pp=2", 2),
    ("[0,1]: dp=2 share=3 | [2]: dp=1 share=1", 3),
    ("[0,1]: pp=2 | [2]: dp=1", 3),
])
def test_every_strategy_trains_on_the_dataset_as_one_device(tmp_path, dataset, one_device, strategy, n):
    np.testing.assert_allclose(_losses(_bundle(tmp_path, dataset, strategy, n), n), one_device, rtol=1e-5)
    assert one_device[-1] < one_device[0]


def test_packed_documents_train_under_dp_as_on_one_device(tmp_path, dataset):
    packed = ("data.packed=true",)
    one = _losses(_bundle(tmp_path, dataset, "[0]: dp=1", 1, packed), 1, steps=4)
    np.testing.assert_allclose(_losses(_bundle(tmp_path, dataset, "[0,1]: dp=2", 2, packed), 2, steps=4), one,
                               rtol=1e-5)


def test_a_resume_on_another_device_count_continues_with_the_same_batches(tmp_path, dataset, one_device):
    ck = str(tmp_path / "ck")
    _losses(_bundle(tmp_path, dataset, "[0,1]: dp=2", 2), 2, steps=4, directory=ck, every=4)
    state = read_manifest(os.path.join(ck, "step-4")).data
    assert state["format"] == "hspmd-sampler" and state["batches"] == 4 and state["offset"] == 32
    resumed = _losses(_bundle(tmp_path, dataset, "[0]: dp=1", 1), 1, steps=8, resume=ck)
    np.testing.assert_allclose(resumed, one_device[4:], rtol=1e-5)


def test_a_resume_far_into_a_run_reads_nothing_before_its_batch(dataset):
    config = load_script(GPT, parse_overrides(SMALL + [f"data.path={dataset}"])).config
    module = load_script_module(GPT)
    feed = open_feed(module, config, 0)
    corpus = feed.loader.dataset.corpus
    feed.restore(None, 10**9)  # a billion batches on: O(1)
    assert corpus.bytes_read == 0
    batch = feed.next(10**9 + 1).full()
    indices = feed.loader.sampler.indices(10**9)
    np.testing.assert_array_equal(batch["ids"], feed.loader.dataset.read(indices)["ids"])
    assert corpus.bytes_read == 2 * 8 * 9 * 2  # that batch (and the check's read of it)
    feed.close()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_run_on_a_bad_shard_stops_before_it_trains(tmp_path, dataset, damage):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(dataset, bad)
    bundle = _bundle(tmp_path, bad, "[0,1]: dp=2", 2)
    shard = os.path.join(bad, "shard-00002.bin")  # checked by rank 0 (shard i by rank i mod 2), which says so
    data = bytearray(open(shard, "rb").read())
    if damage == "flip":
        data[10] ^= 0x01
    open(shard, "wb").write(bytes(data[:len(data) // 2] if damage == "truncate" else data))
    with pytest.raises(RunError, match="shard-00002.bin: (truncated|fails its checksum)"):
        _losses(bundle, 2, steps=2)
