"""hspmd.data: the permutation, the sampler, each rank's rows, token datasets on disk, the loader
(prefetch, state, padding), packing, `hspmd data prepare/info` and bad data (docs/data.md)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hspmd as hs
from hspmd.data import DataError, Loader, Sampler, row_plan
from hspmd.data.format import read_index
from hspmd.data.permutation import permute
from hspmd.data.prepare import prepare
from hspmd.ir.layout_text import parse_layout

TEXT = ("The quick brown fox jumps over the lazy dog. " * 7 + "\n\n" +
        "Pack my box with five dozen liquor jugs.\n" * 5)


@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
@settings(max_examples=60, deadline=None)
def test_permutation_is_a_bijection_and_a_function_of_its_key(n, seed, epoch):
    image = permute(np.arange(n), n, (seed, epoch))
    assert sorted(image.tolist()) == list(range(n))
    pick = np.arange(n)[::7]
    np.testing.assert_array_equal(permute(pick, n, (seed, epoch)), image[pick])  # any positions alone


def test_permutations_of_other_epochs_differ():
    a, b = permute(np.arange(1000), 1000, (0, 0)), permute(np.arange(1000), 1000, (0, 1))
    assert (a != b).mean() > 0.9 and (a != np.arange(1000)).mean() > 0.9


@given(size=st.integers(1, 60), batch=st.integers(1, 9), drop=st.booleans(), shuffle=st.booleans(),
       k=st.integers(0, 40))
@settings(max_examples=80, deadline=None)
def test_sampler_advance_is_drawing_k_batches(size, batch, drop, shuffle, k):
    if drop and size < batch:
        with pytest.raises(DataError):
            Sampler(size, batch, 3, shuffle, drop)
        return
    s = Sampler(size, batch, 3, shuffle, drop)
    cursor = s.start
    for _ in range(k):
        _, cursor = s.batch(cursor)
    np.testing.assert_array_equal(s.batch(s.advance(s.start, k))[0], s.batch(cursor)[0])
    np.testing.assert_array_equal(s.indices(k), s.batch(cursor)[0])


def test_an_epoch_visits_every_sample_once():
    s = Sampler(23, 5, seed=7, drop_last=False)
    epoch = np.concatenate([s.indices(k) for k in range(s.batches_per_epoch)])
    assert sorted(epoch[epoch >= 0].tolist()) == list(range(23)) and (epoch < 0).sum() == 2
    dropped = Sampler(23, 5, seed=7)
    assert dropped.batches_per_epoch == 4 and dropped.indices(4).tolist() != s.indices(4).tolist()


def test_sampler_state_resumes_with_another_batch_size_and_refuses_another_order():
    s = Sampler(100, 8, seed=1)
    cursor = s.advance(s.start, 5)
    state = json.loads(json.dumps(s.state_dict(cursor, 5)))
    assert s.load_state_dict(state) == cursor
    wider = Sampler(100, 4, seed=1)
    first = wider.batch(wider.load_state_dict(state))[0]
    np.testing.assert_array_equal(first, s.batch(cursor)[0][:4])  # the same samples, in the same order
    with pytest.raises(DataError, match="seed 1 \\(now 2\\)"):
        Sampler(100, 8, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="size 100 \\(now 99\\)"):
        Sampler(99, 8, seed=1).load_state_dict(state)


LAYOUTS = [
    ((16, 4), "[0,1]: split(0)=2"),
    ((16, 4), "[0-3]: split(0)=2, dup=2"),
    ((16, 4), "[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1"),
    ((16, 4), "[0,1]: dup=2"),
    ((16, 4), "[0,1]: split(1)=2"),
    ((2, 8, 4), "[0]: dup=1 | [2]: dup=1 ; hetero=split(1), shares=1:1"),  # a pipeline stage's x@mb
    ((4, 4, 4), "[0,1]: split(1)=2"),
]


@pytest.mark.parametrize("shape,text", LAYOUTS)
def test_a_rank_reads_exactly_the_rows_its_layout_gives_it(shape, text):
    layout = parse_layout(text)
    name = "x@mb" if len(shape) == 3 else "x"
    rows_total = shape[0] * shape[1] if len(shape) == 3 else shape[0]
    batch = np.arange(rows_total * shape[-1], dtype=np.int32).reshape(rows_total, shape[-1])
    full = batch.reshape(shape)
    for rank in layout.devices:
        plan = row_plan([(name, shape, layout, "int32"), ("lr", (), layout)], rank)
        local = plan.local({"x": batch[plan.rows]})
        np.testing.assert_array_equal(local[name], full[layout.slices(rank, shape)])
        assert set(local) == {name}
    split = parse_layout("[0-3]: split(0)=4")
    assert sum(len(row_plan([("x", (16, 4), split)], r).rows) for r in range(4)) == 16  # each row once


def _dataset(tmp_path, name="ds", text=TEXT, tokenizer="byte", shard_bytes=97, files=3):
    paths = []
    for i in range(files):
        p = tmp_path / f"{name}-{i}.txt"
        p.write_text(text[i * 50:] + f" document {i}")
        paths.append(str(p))
    out = str(tmp_path / name)
    prepare(paths, tokenizer, out, shard_bytes=shard_bytes, jobs=2, progress=False)
    return out, paths


def test_a_prepared_dataset_reads_as_the_text_it_came_from(tmp_path):
    out, paths = _dataset(tmp_path)
    ds = hs.data.TokenDataset(out, verify=True)
    assert len(ds.index.shards) >= 3  # small shards: windows run across their boundaries
    stream = np.concatenate([np.append(np.frombuffer(open(p, "rb").read(), np.uint8), 256) for p in paths])
    assert ds.num_tokens == len(stream) and ds.num_documents == 3 and ds.vocab_size == 257 and ds.eod == 256
    w = ds.windows(33)
    rows = w.read(np.arange(len(w)))
    for i in (0, 5, len(w) - 1):
        np.testing.assert_array_equal(rows["ids"][i], stream[i * 32:i * 32 + 32])
        np.testing.assert_array_equal(rows["targets"][i], stream[i * 32 + 1:i * 32 + 33])
    spans = ds.document_spans(np.arange(3))
    assert [int(b - a) for a, b in spans] == [len(open(p, "rb").read()) + 1 for p in paths]
    mem = hs.data.tokens(stream, vocab_size=257).windows(33)
    np.testing.assert_array_equal(mem.read([3, 1])["ids"], w.read([3, 1])["ids"])
    assert hs.data.vocab_size(out) == 257


def test_bpe_prepare_trains_on_the_corpus_and_writes_its_tokenizer(tmp_path):
    out, _ = _dataset(tmp_path, tokenizer="bpe:300", shard_bytes=1 << 20)
    index = read_index(out)
    assert index.tokenizer == "bpe" and 257 < index.vocab_size <= 300 and index.eod is not None
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    ds = hs.data.TokenDataset(out)
    first = ds.documents().read([0])["tokens"][0]
    assert first[-1] == index.eod and tok.decode(first[:-1].tolist()) == TEXT + " document 0"


@pytest.mark.parametrize("damage,message", [
    ("truncate", "truncated"),
    ("grow", "longer than its index says"),
    ("index", "the index says"),
    ("flip", "fails its checksum"),
])
def test_bad_data_is_one_error_naming_the_shard(tmp_path, damage, message):
    out, _ = _dataset(tmp_path)
    shard = os.path.join(out, "shard-00001.bin")
    data = bytearray(open(shard, "rb").read())
    if damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "grow":
        data += b"\0\0"
    elif damage == "flip":
        data[3] ^= 0x01
    if damage == "index":
        index = json.load(open(os.path.join(out, "index.json")))
        index["shards"][1]["tokens"] += 1
        json.dump(index, open(os.path.join(out, "index.json"), "w"))
    else:
        open(shard, "wb").write(bytes(data))
    with pytest.raises(DataError) as err:
        hs.data.TokenDataset(out, verify=True)
    assert message in str(err.value) and "shard-00001" in str(err.value) and "\n" not in str(err.value)


def test_ids_at_or_above_the_vocabulary_are_refused_naming_the_shard(tmp_path):
    out, _ = _dataset(tmp_path)
    with pytest.raises(DataError, match=r"shard-\d+\.bin: token id 256 is at or above the model's vocabulary \(200"):
        hs.data.TokenDataset(out).windows(9, vocab_size=200)
    shard = os.path.join(out, "shard-00002.bin")
    ids = np.fromfile(shard, "<u2")
    ids[1] = 4000  # in the file, not in the index: found when the window is read
    ids.tofile(shard)
    w = hs.data.TokenDataset(out).windows(9)
    first = int(read_index(out).shards[0].tokens + read_index(out).shards[1].tokens)
    with pytest.raises(DataError, match=r"shard-00002\.bin: token id 4000 at stream position"):
        w.read([first // 8])


def test_the_loader_prefetches_resumes_and_reads_only_its_rows(tmp_path):
    out, _ = _dataset(tmp_path)
    w = hs.data.TokenDataset(out).windows(9)
    sampler = Sampler(len(w), 6, seed=4)
    plain = [b["ids"] for _, b in zip(range(12), Loader(w, sampler))]
    ahead = Loader(w, sampler, prefetch=3)
    got = [next(ahead)["ids"] for _ in range(5)]
    state = ahead.state_dict()  # 5 handed out, more made ahead
    ahead.close()
    again = Loader(w, sampler, prefetch=2)
    again.load_state_dict(state)
    got += [b["ids"] for _, b in zip(range(7), again)]
    again.close()
    for a, b in zip(plain, got):
        np.testing.assert_array_equal(a, b)
    mine = Loader(w, sampler, rows=[4, 5])
    mine.skip(3)
    before = w.corpus.bytes_read
    np.testing.assert_array_equal(next(mine)["ids"], plain[3][4:])
    assert w.corpus.bytes_read - before == 2 * 9 * 2  # two windows of nine uint16 tokens


def test_a_short_last_batch_is_padded_with_the_pad_values(tmp_path):
    rows = hs.data.ArrayDataset({"x": np.arange(10.0).reshape(5, 2), "y": np.arange(5)})
    unpadded = Loader(rows, Sampler(5, 3, shuffle=False, drop_last=False))
    next(unpadded)
    with pytest.raises(DataError, match="no pad value"):
        next(unpadded)
    loader = Loader(rows, Sampler(5, 3, shuffle=False, drop_last=False), pad={"x": 0.0, "y": -100})
    next(loader)
    last = next(loader)
    np.testing.assert_array_equal(last["y"], [3, 4, -100])
    np.testing.assert_array_equal(last["x"][2], [0.0, 0.0])


def test_packed_windows_keep_documents_apart():
    docs = [np.arange(1, 4), np.arange(10, 16), np.arange(20, 22), np.arange(30, 45)]
    packed = hs.data.tokens(None, documents=docs, vocab_size=50).packed(8)
    rows = packed.read(np.arange(len(packed)))
    seen = []
    for ids, targets, seg in zip(rows["ids"], rows["targets"], rows["segments"]):
        for t in range(7):
            if targets[t] != -100:
                assert seg[t] >= 0 and targets[t] == ids[t] + 1  # a next token of the same document
                seen.append((ids[t], targets[t]))
    want = {(int(a), int(a) + 1) for d in docs for a in d[:-1]}
    assert {(int(a), int(b)) for a, b in seen} == want and len(seen) == len(want)  # each pair learnt once


def test_from_hf_reads_rows_of_a_datasets_table():
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"x": np.arange(12).reshape(6, 2).tolist(), "y": list(range(6)),
                                        "text": [str(i) for i in range(6)]})
    ds = hs.data.from_hf(table, columns=["x", "y"])
    got = ds.read([4, 1])
    np.testing.assert_array_equal(got["x"], [[8, 9], [2, 3]])
    np.testing.assert_array_equal(got["y"], [4, 1])
    assert len(ds) == 6 and next(Loader(ds, Sampler(6, 3, shuffle=False)))["y"].tolist() == [0, 1, 2]
    with pytest.raises(DataError, match="no column 'z'"):
        hs.data.from_hf(table, columns=["z"])


def test_data_prepare_and_info_on_the_command_line(tmp_path, cli):
    a = tmp_path / "a.jsonl"
    a.write_text("\n".join(json.dumps({"text": f"line {i} of the corpus"}) for i in range(20)))
    proc = cli("hspmd", "data", "prepare", str(a), "--tokenizer", "byte", "-o", str(tmp_path / "ds"),
               "--shard-size", "100")
    assert proc.returncode == 0, proc.stderr
    assert "20 documents" in proc.stdout
    info = cli("hspmd", "data", "info", str(tmp_path / "ds"))
    assert info.returncode == 0 and "documents: 20" in info.stdout and "checksums: ok" in info.stdout
    again = cli("hspmd", "data", "prepare", str(a), "--tokenizer", "bpe:x", "-o", str(tmp_path / "ds2"))
    assert again.returncode == 1 and again.stderr.count("\n") == 1 and "bpe:VOCAB" in again.stderr
    shard = tmp_path / "ds" / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    bad = cli("hspmd", "data", "info", str(tmp_path / "ds"))
    assert bad.returncode == 1 and "shard-00000.bin: truncated" in bad.stderr and "Traceback" not in bad.stderr


def test_tracing_needs_a_batchs_shapes_not_a_dataset_that_fills_it():
    """A batch larger than the dataset: tracing (compile, plan) gets a padded batch of the asked
    rows; training on it still refuses in one line."""
    from hspmd.frontend.script import ScriptError, load_script

    script = load_script(os.path.join(os.path.dirname(__file__), "..", "examples", "gpt.py"),
                         {"data.batch_size": 100000, "model.seq_len": 8})
    first = next(script.batches(shapes_only=True))
    assert {k: v.shape for k, v in first.items()} == {"ids": (100000, 8), "targets": (100000, 8)}
    with pytest.raises(ScriptError, match="too few for one batch of 100000"):
        next(script.batches())
