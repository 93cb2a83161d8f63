"""The NCCL communicator (`hspmd/runtime/comm/nccl.py`) without a GPU: ranks are threads over
the in-process host communicator, NCCL is `tests/fake_nccl.py` on host memory, and device
arrays live on `EmulatedDevice`s (host addresses as pointers). Checked: which NCCL
communicators are made and by whom (unique ids made by a group's first rank and sent through
the host), the dtype mapping, the pairing of grouped sends and receives, and the results.
The same calls on a real GPU at one rank (all NCCL allows on one GPU): the gpu-marked test."""

from __future__ import annotations

import numpy as np
import pytest

from hspmd.runtime.comm.base import CommError
from hspmd.runtime.comm.inprocess import InProcessCommunicator, run_spmd
from hspmd.runtime.comm.nccl import NcclCommunicator, nccl_dtype
from hspmd.runtime.cuda.device import DeviceArray
from hspmd.runtime.cuda.emulated import EmulatedDevice

from fake_nccl import FakeNccl, FakeNccl13, FakeNcclError


def device_array(device, values) -> DeviceArray:
    """Return `values` uploaded to `device` as a DeviceArray."""
    values = np.ascontiguousarray(values)
    a = DeviceArray(device, device.alloc(values.nbytes), values.shape, values.dtype)
    device.upload(a.ptr, values)
    return a


def empty(device, shape, dtype) -> DeviceArray:
    dtype = np.dtype(dtype)
    return DeviceArray(device, device.alloc(int(np.prod(shape)) * dtype.itemsize), tuple(shape), dtype)


def data(rank: int, shape=(4, 3), dtype=np.float32) -> np.ndarray:
    return (np.arange(np.prod(shape)).reshape(shape) * (rank + 1) + rank).astype(dtype)


def test_collectives_over_the_world_and_subgroups_give_the_sums_and_chunks():
    nccl = FakeNccl()

    def rank(host):
        dev, r = EmulatedDevice(), host.rank
        with NcclCommunicator(host, stream=7, nccl=nccl) as comm:
            out = {}
            a = device_array(dev, data(r))
            out["world"] = np.asarray(comm.all_reduce(a, (0, 1, 2)))  # in place
            if r in (0, 2):
                b = device_array(dev, data(r))
                out["pair"] = np.asarray(comm.all_reduce(b, (2, 0), out=empty(dev, (4, 3), np.float32)))
            g = empty(dev, (12, 3), np.float32)
            out["gather"] = np.asarray(comm.all_gather(device_array(dev, data(r)), (0, 1, 2), g))
            s = empty(dev, (2, 3), np.float32)
            out["scatter"] = np.asarray(comm.reduce_scatter(device_array(dev, data(r, (6, 3))), (0, 1, 2), s))
            if r in (1, 2):
                out["bcast"] = np.asarray(comm.broadcast(device_array(dev, data(r)), (1, 2), root=2))
            t = empty(dev, (6, 2), np.int64)
            out["a2a"] = np.asarray(comm.all_to_all(device_array(dev, data(r, (6, 2), np.int64)), (0, 1, 2), t))
        return out

    res = run_spmd(3, rank, timeout=30)
    total = sum(data(r) for r in range(3))
    for r in range(3):
        np.testing.assert_array_equal(res[r]["world"], total)
        np.testing.assert_array_equal(res[r]["gather"], np.concatenate([data(q) for q in range(3)]))
        np.testing.assert_array_equal(res[r]["scatter"], sum(data(q, (6, 3)) for q in range(3))[2 * r: 2 * r + 2])
        np.testing.assert_array_equal(res[r]["a2a"], np.concatenate([data(q, (6, 2), np.int64)[2 * r: 2 * r + 2]
                                                                     for q in range(3)]))
    # group (2, 0): member order is the tuple's, NCCL rank 0 is global rank 2, which made the id
    for r in (0, 2):
        np.testing.assert_array_equal(res[r]["pair"], data(0) + data(2))
    for r in (1, 2):
        np.testing.assert_array_equal(res[r]["bcast"], data(2))
    assert nccl.ids_made == 3  # (0,1,2), (2,0), (1,2): one communicator per group, made once
    assert {c[2] for c in nccl.calls} == {"allReduce", "allGather", "reduceScatter", "broadcast", "send", "recv"}
    # the broadcast's root is NCCL rank 1 of group (1, 2)
    assert {c[-1] for c in nccl.calls if c[2] == "broadcast"} == {1}


def test_pipeline_sends_pair_up_in_grouped_calls():
    nccl = FakeNccl()

    def rank(host):
        dev, r, n = EmulatedDevice(), host.rank, host.size
        comm = NcclCommunicator(host, nccl=nccl)
        got = empty(dev, (5,), np.float64)
        # a ring: everyone sends first and receives second, which deadlocks unless grouped
        comm.sendrecv(device_array(dev, np.full(5, r, np.float64)), (r + 1) % n, got, (r - 1) % n)
        back = empty(dev, (2,), np.int32)
        if r == 0:
            comm.send(device_array(dev, np.array([7, 8], np.int32)), 3)
        if r == 3:
            comm.recv(back, 0)
        # the same through the communicator of a named group
        inner = empty(dev, (1,), np.float32)
        comm.exchange(sends=[(device_array(dev, np.array([r], np.float32)), r ^ 1)], recvs=[(inner, r ^ 1)],
                      group=(0, 1, 2, 3))
        return np.asarray(got), np.asarray(back), float(np.asarray(inner)[0])

    res = run_spmd(4, rank, timeout=30)
    for r in range(4):
        np.testing.assert_array_equal(res[r][0], np.full(5, (r - 1) % 4))
        assert res[r][2] == r ^ 1
    np.testing.assert_array_equal(res[3][1], [7, 8])
    # pairs (0,1) (1,2) (2,3) (0,3) of the ring, (0,3) again for the send, and the world
    assert nccl.ids_made == 5


def test_a_receive_must_match_its_send():
    def rank(host):
        dev = EmulatedDevice()
        comm = NcclCommunicator(host, nccl=nccl)
        if host.rank == 0:
            comm.send(device_array(dev, np.zeros(4, np.float32)), 1)
        else:
            comm.recv(empty(dev, (3,), np.float32), 0)

    nccl = FakeNccl()
    with pytest.raises(FakeNcclError, match="receives 3 of type .* which sent 4"):
        run_spmd(2, rank, timeout=30)


def test_groups_opened_in_different_orders_are_refused_in_one_line():
    def rank(host):
        comm = NcclCommunicator(host, nccl=nccl)
        if host.rank == 0:
            comm.communicator((0, 1))
        elif host.rank == 1:
            comm.communicator((0, 1, 2))

    nccl = FakeNccl()
    said = r"rank 1 opened NCCL group \(0, 1, 2\) but rank 0 sent the id of another group \(of 2 ranks\)"
    with pytest.raises(CommError, match=said):
        run_spmd(3, rank, timeout=30)


def test_open_groups_makes_the_callers_groups_in_sorted_order():
    nccl = FakeNccl()

    def rank(host):
        comm = NcclCommunicator(host, nccl=nccl)
        groups = [(1, 2), (0, 1, 2), (0, 1)]  # every rank lists them in its own order
        comm.open_groups(groups if host.rank != 1 else groups[::-1])
        return sorted(comm._comms)

    res = run_spmd(3, rank, timeout=30)
    assert res == [[(0, 1), (0, 1, 2)], [(0, 1), (0, 1, 2), (1, 2)], [(0, 1, 2), (1, 2)]]
    assert nccl.ids_made == 3


@pytest.mark.parametrize("dtype, name", [("float32", "NCCL_FLOAT32"), ("float64", "NCCL_FLOAT64"),
                                         ("float16", "NCCL_FLOAT16"), ("int32", "NCCL_INT32"),
                                         ("int64", "NCCL_INT64"), ("uint8", "NCCL_UINT8"), ("bool", "NCCL_UINT8")])
def test_dtypes_map_to_nccls(dtype, name):
    nccl = FakeNccl()
    assert nccl_dtype(nccl, dtype) == getattr(nccl, name)


def test_dtypes_nccl_cannot_move_or_sum_are_refused():
    nccl = FakeNccl()
    with pytest.raises(CommError, match="NCCL cannot sum arrays of bool"):
        nccl_dtype(nccl, np.bool_, summed=True)
    with pytest.raises(CommError, match="NCCL cannot move arrays of complex64"):
        nccl_dtype(nccl, np.complex64)


def test_bfloat16_maps_to_nccls():
    import ml_dtypes  # the project's bfloat16 (hspmd.ir.types)

    nccl = FakeNccl()
    assert nccl_dtype(nccl, ml_dtypes.bfloat16, summed=True) == nccl.NCCL_BFLOAT16


def test_bad_buffers_and_peers_are_one_line_errors():
    nccl = FakeNccl()
    (host,) = InProcessCommunicator.create_world(1)
    dev = EmulatedDevice()
    comm = NcclCommunicator(host, nccl=nccl)
    a = device_array(dev, np.zeros(6, np.float32))
    with pytest.raises(CommError, match="out has 5 elements"):
        comm.all_reduce(a, (0,), out=empty(dev, (5,), np.float32))
    with pytest.raises(CommError, match="out has dtype float64"):
        comm.all_gather(a, (0,), empty(dev, (6,), np.float64))
    with pytest.raises(CommError, match="root 3 is not a member"):
        comm.broadcast(a, (0,), root=3)
    with pytest.raises(CommError, match="rank 0 is not another rank"):
        comm.send(a, 0)
    with pytest.raises(CommError, match="outside a world"):
        comm.all_reduce(a, (0, 4))
    comm.close()
    with pytest.raises(CommError, match="closed"):
        comm.all_reduce(a, (0,))


@pytest.mark.parametrize("module", [FakeNccl, FakeNccl13])
def test_unique_ids_reach_the_communicator_in_the_form_cupy_takes(module):
    """CuPy 14 makes and takes the id as bytes (the GPU machine's CuPy), CuPy 13 as a tuple of
    signed chars: the members of a group join one communicator with either; the id crosses the
    host communicator as its 128 bytes (NULs and bytes over 127 among them)."""
    nccl = module()

    def rank(host):
        dev = EmulatedDevice()
        with NcclCommunicator(host, nccl=nccl) as comm:
            return np.asarray(comm.all_reduce(device_array(dev, data(host.rank)), (0, 1, 2)))

    res = run_spmd(3, rank, timeout=30)
    for r in range(3):
        np.testing.assert_array_equal(res[r], sum(data(q) for q in range(3)))
    assert nccl.ids_made == 1 and len(nccl._cliques) == 1
    (key,) = nccl._cliques
    assert 0 in key and max(key) > 127


def test_id_bytes_takes_both_forms_and_checks_the_length():
    from hspmd.runtime.comm.nccl import id_bytes

    raw = FakeNccl().get_unique_id()
    assert isinstance(raw, bytes) and id_bytes(raw) == raw
    assert id_bytes(FakeNccl13().get_unique_id()) == raw
    with pytest.raises(CommError, match="an NCCL unique id of 3 bytes"):
        id_bytes(b"abc")


def test_an_id_the_module_takes_in_neither_form_is_not_called_a_gpu_per_rank():
    class Picky(FakeNccl):
        def NcclCommunicator(self, ndev, commId, rank):
            raise TypeError("Argument 'commId' has incorrect type (expected list, got bytes)")

    (host,) = InProcessCommunicator.create_world(1)
    with pytest.raises(CommError, match="takes the unique id of group \\(0,\\) neither as bytes") as err:
        NcclCommunicator(host, nccl=Picky()).communicator((0,))
    assert "GPU of its own" not in str(err.value)


def test_a_failure_other_than_two_ranks_on_a_gpu_is_not_called_one():
    class Broken(FakeNccl):
        def NcclCommunicator(self, ndev, commId, rank):
            raise FakeNcclError("NCCL_ERROR_SYSTEM_ERROR: unhandled system error")

    (host,) = InProcessCommunicator.create_world(1)
    with pytest.raises(CommError, match="NCCL refused a communicator .*SYSTEM_ERROR") as err:
        NcclCommunicator(host, nccl=Broken()).communicator((0,))
    assert "GPU of its own" not in str(err.value)


def test_cupy_without_nccl_is_said_when_a_group_needs_it():
    nccl = FakeNccl()
    nccl.available = False  # `cupy.cuda.nccl` where CuPy found no NCCL library
    (host,) = InProcessCommunicator.create_world(1)
    comm = NcclCommunicator(host, nccl=nccl)  # made: runs whose groups all go through the host never ask
    with pytest.raises(CommError, match="NCCL is not available to CuPy here"):
        comm.communicator((0,))
    assert nccl.ids_made == 0


def test_a_refused_communicator_says_why_in_one_line():
    class Refusing(FakeNccl):
        def NcclCommunicator(self, ndev, commId, rank):
            raise FakeNcclError("NCCL_ERROR_INVALID_USAGE")

    (host,) = InProcessCommunicator.create_world(1)
    comm = NcclCommunicator(host, nccl=Refusing())
    with pytest.raises(CommError, match="NCCL refused a communicator for group \\(0,\\).*GPU of its own"):
        comm.communicator((0,))


@pytest.mark.gpu
def test_nccl_at_one_rank_on_the_gpu(gpu):
    """cupy.cuda.nccl itself, one rank on GPU 0 (NCCL refuses two ranks on one GPU)."""
    (host,) = InProcessCommunicator.create_world(1)
    with NcclCommunicator(host, stream=gpu.stream.ptr) as comm:
        a = device_array(gpu, data(0, (8, 3)))
        np.testing.assert_array_equal(np.asarray(comm.all_reduce(a, (0,))), data(0, (8, 3)))
        g = empty(gpu, (8, 3), np.float32)
        np.testing.assert_array_equal(np.asarray(comm.all_gather(a, (0,), g)), data(0, (8, 3)))
        s = empty(gpu, (8, 3), np.float32)
        np.testing.assert_array_equal(np.asarray(comm.reduce_scatter(a, (0,), s)), data(0, (8, 3)))
        b = empty(gpu, (8, 3), np.float32)
        np.testing.assert_array_equal(np.asarray(comm.broadcast(a, (0,), 0, out=b)), data(0, (8, 3)))
        t = empty(gpu, (8, 3), np.float32)
        np.testing.assert_array_equal(np.asarray(comm.all_to_all(a, (0,), t)), data(0, (8, 3)))
        h = device_array(gpu, np.arange(5, dtype=np.float16))
        np.testing.assert_array_equal(np.asarray(comm.all_reduce(h, (0,))), np.arange(5, dtype=np.float16))


@pytest.mark.mpi
def test_unique_ids_go_over_mpi_from_each_groups_first_rank(tmp_path):
    import json
    import subprocess
    from pathlib import Path

    from hspmd.runtime.launcher.launch import mpiexec_command

    n = 3
    script = Path(__file__).parent / "mpi_scripts" / "nccl_ids.py"
    proc = subprocess.run(mpiexec_command(n, [str(script), str(tmp_path)]), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    groups = {key for s in seen for key in s}
    assert len(groups) == 2 + 3  # the world in two orders, three pairs
    for key in groups:
        g = json.loads(key)
        made = [seen[r][key] for r in g]
        maker = g[0]
        assert all(m[0] == len(g) for m in made)
        assert [m[2] for m in made] == list(range(len(g)))  # NCCL rank = position in the group
        assert all(m[1] == [(maker * 7 + i) % 256 for i in range(128)] for m in made)  # the first rank's id, as bytes
