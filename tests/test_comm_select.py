"""The choice of transport per communicator group (`hspmd/runtime/comm/select.py`), without a
GPU: NCCL where every member holds a GPU of its own, host-staged MPI where members share a GPU or
mix GPU and CPU ranks, plain MPI for CPU ranks; ranks take GPUs by local rank, honouring
`CUDA_VISIBLE_DEVICES`, and more ranks than GPUs share them."""

from __future__ import annotations

import pytest

from hspmd.runtime.comm.base import CommError
from hspmd.runtime.comm.inprocess import run_spmd
from hspmd.runtime.comm.select import (
    RankPlace,
    choose_transport,
    gather_places,
    gpu_of,
    place_of_rank,
    transports,
    visible_gpus,
)
from hspmd.runtime.cuda.select import local_rank


def places_of(kinds, gpu_count, env=None, ranks_per_host=None):
    """Return the places of ranks of `kinds` on hosts of `gpu_count` GPUs (one host, or hosts of
    `ranks_per_host` ranks each), local rank = rank on its host."""
    per = ranks_per_host or len(kinds)
    return [place_of_rank(k, r % per, gpu_count, env or {}, host=f"h{r // per}") for r, k in enumerate(kinds)]


def test_more_ranks_than_gpus_share_them_and_sharing_groups_go_through_the_host():
    places = places_of(["cuda"] * 5, gpu_count=2)
    assert [p.gpu for p in places] == ["0", "1", "0", "1", "0"]
    got = transports([(0, 1), (1, 2), (0, 2), (0, 1, 2), (3,), (0, 1, 2, 3, 4)], places)
    assert got == {(0, 1): "nccl", (1, 2): "nccl", (0, 2): "staged", (0, 1, 2): "staged", (3,): "nccl",
                   (0, 1, 2, 3, 4): "staged"}


def test_one_gpu_n_ranks_is_all_host_staged():  # the GPU machine's test setup: -n 2 --device cuda on one GPU
    places = places_of(["cuda", "cuda"], gpu_count=1)
    assert choose_transport((0, 1), places) == "staged"


def test_mixed_and_cpu_groups():
    places = places_of(["cuda", "cuda", "cpu", "cpu"], gpu_count=2)
    assert transports([(0, 1), (1, 2), (2, 3), (0, 1, 2, 3)], places) == {
        (0, 1): "nccl", (1, 2): "staged", (2, 3): "mpi", (0, 1, 2, 3): "staged"}
    assert places[2] == RankPlace("cpu", "h0")


def test_the_same_gpu_index_on_two_hosts_is_two_gpus():
    places = places_of(["cuda"] * 4, gpu_count=1, ranks_per_host=2)  # two hosts, one GPU each
    assert transports([(0, 2), (0, 1), (1, 3)], places) == {(0, 2): "nccl", (0, 1): "staged", (1, 3): "nccl"}


def test_cuda_visible_devices_names_the_gpus():
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == ["0", "1"]  # what CUDA reports caps it
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "1,x,2"}) == ["1"]  # CUDA stops at an invalid entry
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "1,1,2"}) == ["1"]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "GPU-ab12,3"}) == ["GPU-ab12", "3"]
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus(4, {"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert visible_gpus(3, {}) == ["0", "1", "2"]
    assert [gpu_of(r, ["2", "3"]) for r in range(4)] == [(0, "2"), (1, "3"), (0, "2"), (1, "3")]
    with pytest.raises(CommError, match="sees no GPU"):
        gpu_of(0, [])


def test_ranks_that_see_different_gpus_compare_them_by_name():
    # each rank of a host sees one GPU of its own through CUDA_VISIBLE_DEVICES (ordinal 0 each)
    places = [place_of_rank("cuda", r, 1, {"CUDA_VISIBLE_DEVICES": str(r)}, host="h") for r in range(2)]
    assert [p.gpu for p in places] == ["0", "1"] and choose_transport((0, 1), places) == "nccl"
    same = [place_of_rank("cuda", r, 1, {"CUDA_VISIBLE_DEVICES": "5"}, host="h") for r in range(2)]
    assert choose_transport((0, 1), same) == "staged"


def test_local_rank_comes_from_the_launcher(monkeypatch):
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert local_rank(5) == 5
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert local_rank(5) == 1
    assert place_of_rank("cuda", local_rank(5), 3, {}, host="h").gpu == "1"


def test_places_are_checked():
    with pytest.raises(CommError, match="cpu or cuda, not 'tpu'"):
        RankPlace("tpu", "h")
    with pytest.raises(CommError, match="a cuda rank needs GPU"):
        RankPlace("cuda", "h")


def test_gather_places_gives_every_rank_everyones():
    def rank(comm):
        kind = "cpu" if comm.rank == 2 else "cuda"
        return gather_places(comm, place_of_rank(kind, comm.rank, 2, {}, host="node-a"))

    res = run_spmd(3, rank, timeout=30)
    expected = [RankPlace("cuda", "node-a", "0"), RankPlace("cuda", "node-a", "1"), RankPlace("cpu", "node-a")]
    assert res == [expected] * 3
