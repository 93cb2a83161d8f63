"""Trace events of a training run, in the Chrome / Perfetto trace-event format.

`hspmd run --trace FILE` gives each rank a `Tracer` (there is no global one: the worker hands
it to `Plan.run`, to the checkpoint writer and to whatever else records). A tracer keeps
complete ("ph": "X") events: every step of the plan under its IR name (`graph.matmul`,
`comm.all_reduce`, `kernel.fused @NAME`, a bucket's `comm.all_reduce.start` and `.wait`,
`comm.send.wait`; `kernel.batch_chain` for a batch chain run by slices, its steps' names in
args `steps`), the inlined forward and backward of each micro-batch of a pipeline
(`pipeline.run @pipeline_forward`, args microbatch), one `train_step` per training step, and
the checkpoint writes. Communication carries its bytes; every event the step number.

Threads (`tid`): `MAIN` the training thread, `CHECKPOINT` the background checkpoint writer,
`BUCKETS + k` all-reduce bucket k from its start to the end of its wait (what overlapped the
backward pass; buckets in flight together get rows of their own). The process (`pid`) is the rank, named "rank r".

Clocks: a rank times with `time.perf_counter_ns` and places it on the wall clock once; the
ranks agree on one origin (rank 0's wall clock when the tracers are made, broadcast), so
the timestamps, in microseconds from that origin, line up across ranks of one host (and of
hosts whose clocks agree). `gather` brings every rank's events to rank 0 through the
communicator; `write_trace` writes `{"traceEvents": [...]}`, loadable in ui.perfetto.dev.
"""

from __future__ import annotations

import contextlib

import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from hspmd.codegen.schedule.model import SlotType, Step, nbytes
from hspmd.runtime.comm.base import Communicator

#: the training thread, the background checkpoint writer, the first all-reduce bucket's row
MAIN, CHECKPOINT, BUCKETS = 0, 1, 100
THREAD_NAMES = {MAIN: "train", CHECKPOINT: "checkpoint writer"}
#: the message tags of `Tracer.gather` (above any tag a program or a parameter gather uses)
GATHER_TAG = 32001

#: step kinds that get no event of their own (views of a micro-batch, the light polls)
_UNTRACED = ("take", "poll", "gather-poll")


@dataclass(frozen=True)
class StepLabel:
    """What a traced plan step is called: its IR name, category, fixed args (bytes moved,
    bucket), and the pipeline function and micro-batch it belongs to."""

    name: str
    cat: str
    args: dict = field(default_factory=dict)
    kind: str = "op"
    scope: str = ""
    microbatch: int | None = None
    bucket: int | None = None


def step_label(step: Step, types: Sequence[SlotType], bucket_bytes: Sequence[int] = ()) -> StepLabel | None:
    """Return the label of schedule step `step` (None for a step that gets no event).

    Categories: "kernel", "comm" (a collective, a send or receive, a bucket's start), "wait" (a
    bucket's wait, the sends' wait). Communication carries `bytes`: of its operands, or of its
    results where it has none (a receive); a bucket's, from `bucket_bytes`."""
    if step.kind in _UNTRACED:
        return None
    args: dict = {}
    if step.kind in ("wait-sends", "gather-wait"):
        cat = "wait"
    elif step.kind in ("bucket-start", "bucket-wait"):
        cat = "comm" if step.kind == "bucket-start" else "wait"
        args["bucket"] = step.bucket
        if step.bucket is not None and step.bucket < len(bucket_bytes):
            args["bytes"] = bucket_bytes[step.bucket]
    elif step.name.startswith("comm."):
        cat = "comm"
        args["bytes"] = sum(nbytes(types[s]) for s in (step.ins or step.outs))
    else:
        cat = "kernel"
    if step.microbatch is not None:
        args["microbatch"] = step.microbatch
    return StepLabel(step.name, cat, args, step.kind, step.scope, step.microbatch, step.bucket)


class Tracer:
    """One rank's trace events (see the module docstring)."""

    clock = staticmethod(time.perf_counter_ns)

    def __init__(self, rank: int, origin_ns: int | None = None) -> None:
        """`origin_ns`: the wall-clock time (ns) that timestamps count from (default: now)."""
        wall, perf = time.time_ns(), time.perf_counter_ns()
        self.rank = rank
        self._offset = wall - perf - (wall if origin_ns is None else origin_ns)
        #: (name, category, tid, start ns, end ns, args), clock() readings
        self.events: list[tuple[str, str, int, int, int, dict]] = []
        #: the training step being recorded (put in every event's args)
        self.step = 0

    @classmethod
    def agreed(cls, comm: Communicator) -> Tracer:
        """Return this rank's tracer, its origin rank 0's wall clock (every rank must call this)."""
        origin = np.array([time.time_ns()], dtype=np.int64)
        if comm.size > 1:
            origin = comm.broadcast(origin, tuple(range(comm.size)), 0)
        return cls(comm.rank, int(origin[0]))

    def complete(self, name: str, cat: str, start: int, end: int, tid: int = MAIN, args: dict | None = None) -> None:
        """Record a complete event from `start` to `end` (`clock()` readings); any thread may call it."""
        self.events.append((name, cat, tid, start, end, {"step": self.step, **(args or {})}))

    @contextmanager
    def span(self, name: str, cat: str, tid: int = MAIN, **args) -> Iterator[None]:
        """Record the time the `with` block takes as one event."""
        start = self.clock()
        try:
            yield
        finally:
            self.complete(name, cat, start, self.clock(), tid, args)

    def plan_steps(self, labels: Sequence[StepLabel | None], timings: Sequence[tuple[int, int, int]]) -> None:
        """Record one run of a plan: `timings` holds (step index, start, end) per step run, `labels`
        each step's label. Adds a span per contiguous run of a pipeline function's steps on one
        micro-batch, and one per all-reduce bucket from its start to the end of its wait."""
        scope: tuple[str, int | None] | None = None
        scope_start = scope_end = 0
        started: dict[int, int] = {}
        for i, start, end in timings:
            label = labels[i]
            if label is None:
                continue
            key = (label.scope, label.microbatch) if label.scope else None
            if key != scope and label.kind in ("op", "sum"):  # a bucket's start or wait stays inside
                if scope is not None:
                    self.complete(f"pipeline.run @{scope[0]}", "pipeline", scope_start, scope_end,
                                  args={"microbatch": scope[1]})
                scope, scope_start = key, start
            scope_end = end
            self.complete(label.name, label.cat, start, end, args=label.args)
            if label.kind == "bucket-start" and label.bucket is not None:
                started[label.bucket] = start
            elif label.kind == "bucket-wait" and label.bucket is not None:
                self.complete("comm.all_reduce", "comm", started.pop(label.bucket, start), end,
                              BUCKETS + label.bucket, label.args)
        if scope is not None:
            self.complete(f"pipeline.run @{scope[0]}", "pipeline", scope_start, scope_end, args={"microbatch": scope[1]})

    def trace_events(self) -> list[dict]:
        """Return this rank's events as trace-event dicts (timestamps in microseconds), with the
        process and thread names first."""
        pid, offset = self.rank, self._offset
        tids = sorted({e[2] for e in self.events} | {MAIN})
        out: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": MAIN, "args": {"name": f"rank {pid}"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": MAIN, "args": {"sort_index": pid}},
        ]
        out += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": t,
                 "args": {"name": THREAD_NAMES.get(t, f"all-reduce bucket {t - BUCKETS}")}} for t in tids]
        for name, cat, tid, start, end, args in list(self.events):
            out.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                        "ts": round((start + offset) / 1e3, 3), "dur": round((end - start) / 1e3, 3), "args": args})
        return out

    def gather(self, comm: Communicator) -> list[dict] | None:
        """Return every rank's events on rank 0, rank by rank (None on the others); every rank
        must call this."""
        mine = self.trace_events()
        if comm.size == 1:
            return mine
        if comm.rank != 0:
            payload = np.frombuffer(bytearray(json.dumps(mine).encode()), dtype=np.uint8)
            comm.send(np.array([payload.size], dtype=np.int64), 0, GATHER_TAG)
            comm.send(payload, 0, GATHER_TAG + 1)
            return None
        out = mine
        for r in range(1, comm.size):
            size = comm.recv(np.empty(1, dtype=np.int64), r, GATHER_TAG)
            payload = comm.recv(np.empty(int(size[0]), dtype=np.uint8), r, GATHER_TAG + 1)
            out += json.loads(payload.tobytes().decode())
        return out


def traced(tracer: Tracer | None, name: str, cat: str, tid: int = MAIN, **args):
    """Return a `with` context recording its block as one event of `tracer` (nothing without one)."""
    return contextlib.nullcontext() if tracer is None else tracer.span(name, cat, tid, **args)


def write_trace(path: str, events: list[dict]) -> None:
    """Write `{"traceEvents": events}` to `path` (a temporary name, then renamed)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.part{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
