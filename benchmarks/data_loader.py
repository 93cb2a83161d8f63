"""The data path at scale: a token dataset on disk, each rank reading only its rows, prefetched, and
resumed without a replay (hs.data, docs/data.md).

    python benchmarks/data_loader.py [--steps 40] [--reps 2] [--big-tokens 1e9] [--resume-at 100000]

Four measurements, each against a peer measured in the same run:

1. **Bytes read per rank under dp=4**: a `Loader` reading rank 0's rows of `[0-3]: split(0)=4`
   (`hspmd.data.rows`) for 500 global batches of 16 windows of 65 tokens, from the 10^7-token
   corpus; the corpus's own count of the bytes it read ÷ the bytes of the global batches (what
   every rank read before: the whole batch). Target <= 0.3.
2. **Resident memory per rank, 10^9 tokens vs 10^7** (2 GB vs 20 MB of uint16 tokens, random
   ids in documents of random lengths, generated here): a fresh process opens the corpus, checks
   every shard's CRC-32 (as a run does), and reads 3,000 batches of rank 0's rows of dp=4 with
   two batches prefetched; its peak resident memory (VmHWM) for the big corpus ÷ for the small
   one. Target <= 1.05.
3. **Resume at step 100,000**: from nothing to the first batch after a resume: open the 10^9-token
   corpus, restore the sampler state (two integers), read the batch. Its peers: today's replay
   (examples/gpt.py before hs.data: `lm_windows` over the text in memory, 100,000 batches drawn
   and dropped), and what a replay costs once the data is on disk (the loader reading 10,000
   batches, times 10). Target <= 1 s.
4. **Step time, on-disk loader with prefetch vs the same batches held in memory** (GPT 2 layers,
   d_model 128, batch 16 x 64, vocabulary 512, dp=2 under `hspmd run -n 2`): the same script reads
   the 10^7-token corpus from disk (2 batches prefetched per rank) or holds all its tokens in
   memory (no prefetch); the same sampler, so the same batches and the same losses. A step's time is
   its `time_s` plus its `data_s` (the loop's wait for the batch) from the log, summed after 5
   warm-up steps; runs alternate, the medians of `--reps` runs are compared. Target <= 1.02.

The last line ends with the headline ratio: step time on disk with prefetch ÷ in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = 512
SEQ = 64
BATCH = 16


def make_corpus(directory: str, tokens: int, seed: int, shard_tokens: int = 100_000_000) -> None:
    """Write a prepared dataset of `tokens` random ids below VOCAB, in documents of 1 to 4,000 tokens."""
    from hspmd.data.format import OFFSET_DTYPE, DatasetIndex, ShardEntry, shard_names, write_index

    os.makedirs(directory)
    rng = np.random.default_rng(seed)
    entries, left, k = [], tokens, 0
    while left:
        n = min(left, shard_tokens)
        ids = rng.integers(0, VOCAB, n, dtype=np.uint16)
        lengths = rng.integers(1, 4001, n // 1000 + 2)
        ends = np.cumsum(lengths)
        ends = np.append(ends[ends < n], n)
        offsets = np.concatenate([[0], ends]).astype(OFFSET_DTYPE)
        names = shard_names(k)
        ids.tofile(os.path.join(directory, names[0]))
        offsets.tofile(os.path.join(directory, names[1]))
        entries.append(ShardEntry(names[0], names[1], n, len(offsets) - 1, int(ids.max()), zlib.crc32(ids.data),
                                  zlib.crc32(offsets.data)))
        left -= n
        k += 1
    write_index(directory, DatasetIndex("uint16", VOCAB, None, "random", tuple(entries)))


def rank_rows(ranks: int = 4, rank: int = 0) -> np.ndarray:
    """Return the rows of a global batch that `rank` of dp=`ranks` reads."""
    from hspmd.data import row_plan
    from hspmd.ir.layout_text import parse_layout

    layout = parse_layout(f"[0-{ranks - 1}]: split(0)={ranks}")
    return row_plan([("ids", (BATCH, SEQ), layout)], rank).rows


def bytes_read(corpus_dir: str, batches: int = 500) -> tuple[int, int]:
    """Return (bytes rank 0 of dp=4 read, bytes of the global batches) over `batches` batches."""
    import hspmd as hs

    windows = hs.data.TokenDataset(corpus_dir).windows(SEQ + 1)
    loader = hs.data.Loader(windows, hs.data.Sampler(len(windows), BATCH, seed=0), rows=rank_rows())
    for _ in range(batches):
        next(loader)
    return windows.corpus.bytes_read, batches * BATCH * (SEQ + 1) * 2


def memory_child(corpus_dir: str, batches: int) -> None:
    """In a fresh process: the loader of rank 0 of dp=4 over `corpus_dir`; print its peak RSS (MiB)."""
    import hspmd as hs

    windows = hs.data.TokenDataset(corpus_dir, verify=True).windows(SEQ + 1)
    loader = hs.data.Loader(windows, hs.data.Sampler(len(windows), BATCH, seed=0), rows=rank_rows(), prefetch=2)
    for _ in range(batches):
        next(loader)
    loader.close()
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    print(json.dumps({"peak_mib": int(status["VmHWM"].split()[0]) / 1024, "now_mib": int(status["VmRSS"].split()[0]) / 1024}))


def peak_memory(corpus_dir: str, batches: int = 3000) -> float:
    out = subprocess.run([sys.executable, __file__, "--child-memory", corpus_dir, str(batches)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT})
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def resume_times(corpus_dir: str, at: int) -> tuple[float, float, float]:
    """Return (restore to the first batch, today's replay in memory, a replay read from disk) in seconds."""
    import hspmd as hs
    from hspmd.data.text import lm_windows, pydoc_text_bytes

    start = time.perf_counter()
    windows = hs.data.TokenDataset(corpus_dir).windows(SEQ + 1)
    sampler = hs.data.Sampler(len(windows), BATCH, seed=0)
    state = sampler.state_dict(sampler.advance(sampler.start, at), at)  # what a checkpoint holds
    loader = hs.data.Loader(windows, sampler)
    loader.load_state_dict(json.loads(json.dumps(state)))
    first = next(loader)
    restore = time.perf_counter() - start
    np.testing.assert_array_equal(first["ids"], windows.read(sampler.indices(at))["ids"])

    start = time.perf_counter()
    batches = lm_windows(pydoc_text_bytes(), BATCH, SEQ, 0)
    for _ in range(at):
        next(batches)
    next(batches)
    today = time.perf_counter() - start

    sample = max(at // 10, 1)
    start = time.perf_counter()
    replay = hs.data.Loader(windows, sampler)
    for _ in range(sample):
        next(replay)
    on_disk = (time.perf_counter() - start) * at / sample
    return restore, today, on_disk


MEMORY_SCRIPT = '''"""examples/gpt.py with every token of the dataset held in memory (benchmarks/data_loader.py)."""
import runpy
import numpy as np
import hspmd as hs

_gpt = runpy.run_path({gpt!r})
config, model, loss, optimizer, vocab_size = (_gpt[k] for k in ("config", "model", "loss", "optimizer", "vocab_size"))
config["data"]["prefetch"] = 0


def dataset(config):
    disk = hs.data.TokenDataset(config["data"]["path"])
    ids = disk.read_rows(np.array([0]), disk.num_tokens)[0]
    return hs.data.tokens(ids, vocab_size=disk.vocab_size).windows(config["model"]["seq_len"] + 1,
                                                                   vocab_size=vocab_size(config))
'''


def step_time(script: str, corpus_dir: str, steps: int, log: str) -> tuple[float, list[float]]:
    """Return (seconds of steps 6.. as time_s + data_s, the losses) of a dp=2 run of `script`."""
    cmd = [sys.executable, "-m", "hspmd.cli.main", "run", "-n", "2", script, "--strategy", "[0,1]: dp=2",
           "--steps", str(steps), "--log", log, "--set", "model.layers=2", "--set", f"data.path={corpus_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(log)]
    return sum(r["time_s"] + r["data_s"] for r in rows[5:]), [r["loss"] for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--big-tokens", type=float, default=1e9)
    parser.add_argument("--small-tokens", type=float, default=1e7)
    parser.add_argument("--resume-at", type=int, default=100_000)
    parser.add_argument("--parts", default="bytes,memory,resume,step",
                        help="which measurements (default all: bytes,memory,resume,step)")
    parser.add_argument("--child-memory", nargs=2, metavar=("DIR", "BATCHES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        memory_child(args.child_memory[0], int(args.child_memory[1]))
        return 0

    work = tempfile.mkdtemp(prefix="hspmd-data-bench-")
    try:
        small, big = os.path.join(work, "small"), os.path.join(work, "big")
        start = time.perf_counter()
        parts = set(args.parts.split(","))
        make_corpus(small, int(args.small_tokens), 1)
        if parts & {"memory", "resume"}:
            make_corpus(big, int(args.big_tokens), 2)
        print(f"corpora: {int(args.small_tokens):,} and {int(args.big_tokens):,} random tokens (vocabulary {VOCAB}, "
              f"uint16) written in {time.perf_counter() - start:.1f} s; load average {os.getloadavg()[0]:.1f}")

        if "bytes" in parts:
            mine, whole = bytes_read(small)
            print(f"bytes read per rank, dp=4: {mine:,} of the global batches' {whole:,} (rank 0 of 4): {mine / whole:.3f}")
        if "memory" in parts:
            small_mib, big_mib = peak_memory(small), peak_memory(big)
            print(f"peak resident memory of a loader process: {big_mib:.1f} MiB over 10^{np.log10(args.big_tokens):.0f} "
                  f"tokens, {small_mib:.1f} MiB over 10^{np.log10(args.small_tokens):.0f}: {big_mib / small_mib:.3f}")

        if "resume" in parts:
            restore, today, on_disk = resume_times(big, args.resume_at)
            print(f"resume at step {args.resume_at:,}: {restore:.4f} s from nothing to the first batch (sampler "
                  f"state); replay: {today:.2f} s today (lm_windows in memory), {on_disk:.1f} s drawing and reading "
                  f"them from disk again; restore / today's replay {restore / today:.4f}")

        if "step" not in parts:
            return 0
        memory_script = os.path.join(work, "gpt_in_memory.py")
        open(memory_script, "w").write(MEMORY_SCRIPT.format(gpt=os.path.join(ROOT, "examples", "gpt.py")))
        disk_script = os.path.join(ROOT, "examples", "gpt.py")
        disk_t, mem_t = [], []
        losses = {}
        for rep in range(args.reps):
            for name, script, times in (("disk", disk_script, disk_t), ("memory", memory_script, mem_t)):
                t, losses[name] = step_time(script, small, args.steps, os.path.join(work, f"{name}{rep}.jsonl"))
                times.append(t)
        same = max(abs(a - b) for a, b in zip(losses["disk"], losses["memory"]))
        disk_med, mem_med = float(np.median(disk_t)), float(np.median(mem_t))
        per = args.steps - 5
        print(f"steps 6-{args.steps} of GPT 2L dp=2 (time_s + data_s), medians of {args.reps}: on disk with prefetch "
              f"{disk_med / per * 1e3:.1f} ms/step {[round(t / per * 1e3, 1) for t in disk_t]}, in memory "
              f"{mem_med / per * 1e3:.1f} ms/step {[round(t / per * 1e3, 1) for t in mem_t]}; losses differ by {same:.1e}")
        print(f"load average {os.getloadavg()[0]:.1f}; step time on disk with prefetch / in memory: {disk_med / mem_med:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
