"""Traces and progress: `hspmd run --trace` writes one Chrome/Perfetto trace with every rank's
events named as the IR's ops (over MPI, with pipelines, buckets and checkpoint writes), tracing
changes no number, and rank 0's step report is a live bar on a terminal and the plain lines
otherwise. No test asserts a timing."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import BIN, EXAMPLES, ROOT, run_cli
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.progress import Progress, batch_items
from hspmd.runtime.trace import BUCKETS, CHECKPOINT, MAIN, Tracer
from hspmd.runtime.worker import train

GPT = os.path.join(EXAMPLES, "gpt.py")
MLP = os.path.join(EXAMPLES, "mlp.py")
SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=8"]
#: what an event may be called: an IR op (dialect.op, a fused kernel with its name), a pipeline
#: function's span, a step, a checkpoint phase
NAME = re.compile(r"^((graph|comm|optim|pipeline)\.[a-z_.]+|kernel\.fused @\w+|kernel\.batch_chain|pipeline\.run @\w+|train_step"
                  r"|checkpoint\.(snapshot|write|manifest|wait|save))$")
LINE = re.compile(r"^step (\d+)/(\d+)  loss -?\d+\.\d{6}  \d+\.\d ms$")


def _sets(values: list[str]) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def _events(path) -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    return doc["traceEvents"]


def _complete(events: list[dict]) -> list[dict]:
    out = [e for e in events if e["ph"] == "X"]
    for e in out:
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and isinstance(e["args"]["step"], int), e
        assert NAME.match(e["name"]), e["name"]
    return out


def _check_ranks(events: list[dict], n: int, steps: int) -> list[dict]:
    """Check the process names and the step events of `n` ranks; return the complete events."""
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(n)}
    xs = _complete(events)
    assert {e["pid"] for e in xs} == set(range(n))
    for r in range(n):
        step_events = [e for e in xs if e["pid"] == r and e["name"] == "train_step"]
        assert [e["args"]["step"] for e in step_events] == list(range(1, steps + 1))
        kernels = [e for e in xs if e["pid"] == r and e["name"] != "train_step" and e["tid"] == MAIN]
        assert {e["args"]["step"] for e in kernels} == set(range(1, steps + 1))
    for e in xs:
        if e["cat"] == "comm":
            assert e["args"]["bytes"] > 0, e
    return xs


@pytest.mark.mpi
def test_mpi_trace_holds_every_ranks_ops_steps_and_checkpoint_writes(tmp_path):
    trace = tmp_path / "t.json"
    proc = run_cli("hspmd", "run", "-n", "2", GPT, *_sets(SMALL), "--steps", "5", "--trace", str(trace),
                   "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", check=True, timeout=300)
    xs = _check_ranks(_events(trace), 2, 5)
    for r in range(2):
        names = {e["name"] for e in xs if e["pid"] == r}
        assert {"graph.matmul", "comm.all_reduce", "train_step", "checkpoint.snapshot"} <= names
        assert any(n.startswith("kernel.fused @") for n in names)
        writes = [e for e in xs if e["pid"] == r and e["name"] == "checkpoint.write"]
        assert [e["args"]["step"] for e in writes] == [2, 4, 5] and {e["tid"] for e in writes} == {CHECKPOINT}
    assert any(e["name"] == "checkpoint.manifest" and e["pid"] == 0 for e in xs)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in _events(trace)
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads[(0, MAIN)] == "train" and threads[(1, CHECKPOINT)] == "checkpoint writer"
    # stdout is not a terminal here: the plain lines, as before
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert [LINE.match(ln).group(1, 2) for ln in lines] == [(str(k), "5") for k in range(1, 6)], proc.stdout
    assert "\r" not in proc.stdout


@pytest.mark.mpi
def test_mpi_pipeline_trace_shows_sends_receives_waits_and_microbatches(tmp_path):
    trace = tmp_path / "pp.json"
    run_cli("hspmd", "run", "-n", "2", GPT, "--strategy", "[0,1]: pp=2", *_sets(SMALL + ["microbatches=2"]),
            "--steps", "2", "--trace", str(trace), check=True, timeout=300)
    xs = _check_ranks(_events(trace), 2, 2)
    for r in range(2):
        mine = [e for e in xs if e["pid"] == r]
        names = {e["name"] for e in mine}
        assert {"comm.send", "comm.recv", "comm.send.wait"} <= names
        for fn in ("pipeline.run @pipeline_forward", "pipeline.run @pipeline_backward"):
            spans = [e for e in mine if e["name"] == fn and e["args"]["step"] == 1]
            assert sorted(e["args"]["microbatch"] for e in spans) == [0, 1]
        # an op of a micro-batch lies inside its pipeline function's span
        spans = [e for e in mine if e["name"].startswith("pipeline.run")]
        inner = [e for e in mine if e["name"] == "comm.recv" and "microbatch" in e["args"]]
        assert inner and all(any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3
                                 and s["args"]["microbatch"] == e["args"]["microbatch"] for s in spans)
                             for e in inner)


def _mlp_bundle(tmp_path) -> str:
    bundle = str(tmp_path / "mlp")
    write_bundle(compile_script(load_script(MLP, parse_overrides(["steps=3"])), "[0,1]: dp=2", 2), bundle)
    return bundle


def test_tracing_changes_no_number_and_shows_bucket_waits(tmp_path, monkeypatch):
    monkeypatch.setenv("HSPMD_BUCKET_BYTES", "65536")  # several overlapped all-reduce buckets
    bundle = _mlp_bundle(tmp_path)
    trace = str(tmp_path / "t.json")
    plain = run_spmd(2, lambda comm: train(bundle, comm, steps=3, quiet=True), timeout=300)
    traced = run_spmd(2, lambda comm: train(bundle, comm, steps=3, quiet=True, trace=trace), timeout=300)
    assert [r.losses for r in plain] == [r.losses for r in traced]
    for k, v in plain[0].params.items():
        np.testing.assert_array_equal(v, traced[0].params[k], err_msg=k)
    xs = _check_ranks(_events(trace), 2, 3)
    for r in range(2):
        mine = [e for e in xs if e["pid"] == r]
        starts = [e for e in mine if e["name"] == "comm.all_reduce.start"]
        waits = [e for e in mine if e["name"] == "comm.all_reduce.wait"]
        flights = [e for e in mine if e["name"] == "comm.all_reduce" and e["tid"] >= BUCKETS]
        assert starts and len(starts) == len(waits) == len(flights)
        assert {e["tid"] - BUCKETS for e in flights} == {e["args"]["bucket"] for e in starts}


def test_tracer_records_spans_from_any_thread_and_gathers_in_process(tmp_path):
    def rank(comm):
        tracer = Tracer.agreed(comm)
        tracer.step = 1
        with tracer.span("checkpoint.write", "checkpoint", CHECKPOINT, bytes=8):
            pass
        return tracer.gather(comm)

    events = run_spmd(3, rank, timeout=60)
    assert events[1] is None and events[2] is None
    xs = _complete(events[0])
    assert sorted(e["pid"] for e in xs) == [0, 1, 2]
    assert all(e["args"] == {"step": 1, "bytes": 8} and e["tid"] == CHECKPOINT for e in xs)


def test_plain_lines_are_unchanged_and_the_bar_shows_loss_and_throughput():
    out = io.StringIO()
    p = Progress(3, 0, bar=False, file=out)
    p.step(1, 2.5, 0.0123)
    p.close()
    assert out.getvalue() == "step 1/3  loss 2.500000  12.3 ms\n"
    out = io.StringIO()
    p = Progress(3, 1, bar=True, file=out)
    p.step(2, 2.25, 0.5, (1000, "tokens"))
    p.close()
    text = out.getvalue()
    assert "loss 2.2500" in text and "2,000 tokens/s" in text and "2/3" in text and "step 1/3" not in text


def test_batch_items_counts_tokens_else_rows():
    assert batch_items({"ids": np.zeros((4, 16), np.int64), "targets": np.zeros((4, 16), np.int64)}) == (64, "tokens")
    assert batch_items({"x": np.zeros((32, 64), np.float32), "y": np.zeros(32, np.int64)}) == (32, "rows")
    assert batch_items({}) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a pseudo-terminal")
def test_a_terminal_gets_the_live_bar(tmp_path):
    import pty

    log = tmp_path / "log.jsonl"
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([os.path.join(BIN, "hspmd"), "run", "-n", "1", MLP, "--steps", "3", "--log", str(log)],
                            stdout=terminal, stderr=subprocess.PIPE, cwd=ROOT)
    os.close(terminal)
    out = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    os.close(controller)
    text = out.decode()
    assert "3/3" in text and "rows/s" in text and "loss" in text
    assert not any(LINE.match(ln.strip()) for ln in text.replace("\r", "\n").splitlines())
    records = [json.loads(line) for line in log.read_text().splitlines()]  # the log is as before
    assert [r["step"] for r in records] == [1, 2, 3] and all({"loss", "time_s", "ranks"} <= set(r) for r in records)
