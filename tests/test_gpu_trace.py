"""`hspmd run --device cuda --trace`: every call of a GPU step in the trace, timed by the device.

On a GPU the calls of a traced step run back to back with a CUDA event between them
(`CupyDevice.time_calls`); the emulated device times each call on the host. Either way every
kernel launch and GEMM of the step is one event of the trace, in order, without overlaps.
"""

from __future__ import annotations

import json
import os

from conftest import EXAMPLES, run_cli


def test_a_gpu_trace_has_every_call_of_the_step_in_order(tmp_path):
    trace = tmp_path / "trace.json"
    r = run_cli("hspmd", "run", "-n", "1", os.path.join(EXAMPLES, "gpt.py"), "--device", "cuda", "--steps", "2",
                "--set", "model.layers=1", "--trace", str(trace), env={"HSPMD_EMULATE_GPU": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(trace.read_text())
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]
    names = [e["name"] for e in events]
    assert any(n.startswith("kernel.fused") for n in names) and "graph.matmul" in names
    steps = [e for e in events if e["name"].startswith(("kernel.fused", "graph."))]
    for a, b in zip(steps, steps[1:]):  # calls on one stream: one after the other
        if a.get("tid") == b.get("tid") and b["ts"] >= a["ts"]:
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-3
