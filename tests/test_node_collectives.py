"""Collectives over several nodes in two tiers (hspmd.runtime.comm.nodes), the slowed link between
simulated nodes (hspmd.runtime.comm.slow_link), and `hspmd run --ranks-per-node`.

The two-tier all-reduce gives the flat left fold's bits for any buffer size, over 2 and 3 nodes,
and sends 1/g of the flat form's bytes across nodes; where it cannot keep the bits (a node's
members not one run of the group, nodes of unlike size) the flat form runs.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from conftest import EXAMPLES, run_cli
from hspmd.runtime.comm.inprocess import InProcessCommunicator
from hspmd.runtime.comm.nodes import NodeCommunicator, node_aware, node_blocks, nodes_of
from hspmd.runtime.comm.slow_link import SlowLinks, link_from_env


def _on_ranks(n: int, fn):
    world = InProcessCommunicator.create_world(n)
    out = [None] * n
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(world[r]))) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_nodes_come_from_hosts_or_ranks_per_node():
    assert nodes_of(["a", "a", "b", "b"]) == [0, 0, 1, 1] and nodes_of(["b", "a", "b"]) == [0, 1, 0]
    assert nodes_of(["h"] * 6, 2) == [0, 0, 1, 1, 2, 2]
    assert node_blocks((0, 1, 2, 3), [0, 0, 1, 1]) == [(0, 1), (2, 3)]
    assert node_blocks((0, 1, 2, 3), [0, 1, 0, 1]) is None  # a node's members not one run: flat
    assert node_blocks((0, 1, 2), [0, 0, 1]) is None  # nodes of unlike size: flat
    assert node_blocks((0, 1), [0, 0]) is None  # one node: flat


@pytest.mark.parametrize("node_of", [[0, 0, 1, 1], [0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1]])
@pytest.mark.parametrize("size", [1, 5, 1000, 200_003])
def test_two_tiers_give_the_flat_bits_and_send_one_gth_of_the_bytes_across(node_of, size):
    n, g = len(node_of), node_of.count(0)
    group = tuple(range(n))

    def run(comm):
        x = np.random.default_rng(comm.rank + size).standard_normal(size).astype(np.float32) * 1e3
        slow = SlowLinks(comm, node_of, 0.0, 1e12)
        two_tier = NodeCommunicator(slow, node_of).all_reduce(x, group)
        across = slow.cross_node_bytes
        flat_link = SlowLinks(comm, node_of, 0.0, 1e12)
        flat = NodeCommunicator(flat_link, node_of, form="flat").all_reduce(x, group)
        return two_tier, flat, comm.all_reduce(x, group), across, flat_link.cross_node_bytes

    out = _on_ranks(n, run)
    for two_tier, flat, plain, _, _ in out:
        assert np.array_equal(two_tier, plain) and np.array_equal(flat, plain)
    across, flat_across = sum(o[3] for o in out), sum(o[4] for o in out)
    if size * 4 >= 256 * 1024:  # the flat form's reduce-scatter and all-gather: 2 (n - g) / n of it per rank
        assert across <= flat_across / g * 1.05 + 64 * n


def test_the_slow_link_delays_what_crosses_nodes():
    node_of = [0, 1]
    assert link_from_env({"HSPMD_SLOW_LINK": "50:0.1"}) == pytest.approx((50e-6, 0.1e9)) and link_from_env({}) is None

    def run(comm):
        import time

        slow = SlowLinks(comm, node_of, 0.02, 1e6)  # 20 ms, 1 MB/s: 10 kB take 10 ms more
        comm.barrier()
        if comm.rank == 0:
            sent = time.time()
            slow.send(np.zeros(1250), 1)
            comm.send(np.array([sent]), 1, 7)
            return None, slow.cross_node_bytes
        slow.recv(np.empty(1250), 0)
        got = time.time()
        return got - comm.recv(np.empty(1), 0, 7)[0], slow.cross_node_bytes

    (_, b0), (waited, b1) = _on_ranks(2, run)
    assert b0 == 10_000 and b1 == 0
    assert waited >= 0.0299  # the receiver has it a latency and its length after it was sent


def test_one_node_is_left_as_it_is():
    comm = InProcessCommunicator.create_world(1)[0]
    assert node_aware(comm, ["h"], 2) is comm


def _losses(path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(path) if line.startswith("{")]


@pytest.mark.mpi
def test_hspmd_run_on_two_simulated_nodes_gives_the_flat_losses(tmp_path):
    gpt = [os.path.join(EXAMPLES, "gpt.py"), "--set", "model.layers=1", "--set", "data.batch_size=8"]
    for name, extra in (("flat", []), ("nodes", ["--ranks-per-node", "2"])):
        run_cli("hspmd", "run", "-n", "4", *gpt, "--steps", "3", "--strategy", "[0-3]: dp=4", "--log",
                str(tmp_path / f"{name}.jsonl"), *extra, check=True, timeout=300,
                env={"HSPMD_SLOW_LINK": "1"} if extra else None)
    assert _losses(tmp_path / "nodes.jsonl") == _losses(tmp_path / "flat.jsonl")
