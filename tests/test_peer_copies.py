"""In-memory peer copies (`--elastic --redundancy peer[:K]`, hspmd.runtime.launcher.peer).

Who keeps what (a property over layouts: any one rank, or any one host while another is left, can
be lost without losing a region); the copies made by in-process ranks, a recovery planned from
them, and the state restored on fewer ranks under another strategy (bit for bit the state of a
run that never stopped), also across simulated hosts; then real kill -9 runs through the elastic
launcher, of a strategy family drawn per run (dp, tp, pp, zero=3, unlike groups; each family's
recovery from the copies runs in process every run), losing at most one step and keeping the
1-device losses.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BIN, EXAMPLES, ROOT, RUN_SEED
from hspmd.codegen.schedule.model import Leaf
from hspmd.ir.layout_text import parse_layout
from hspmd.runtime.launcher.peer.placement import buddies, holders, kept_pieces, wards
from hspmd.runtime.launcher.peer.recovery import plan_recovery, read_recovery, write_recovery
from hspmd.runtime.launcher.peer.restore import PeerRestoreError, load_peer_state
from hspmd.runtime.launcher.peer.session import PeerOptions, restart_line
from hspmd.runtime.launcher.peer.slots import remove_shm, shm_directory

MLP = os.path.join(EXAMPLES, "mlp.py")


# -- who keeps what ----------------------------------------------------------------------------

def test_buddies_ring_over_hosts_then_ranks():
    assert buddies(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert buddies(["a", "b", "c"]) == [1, 2, 0]
    assert buddies(["a", "a", "a", "b"]) == [3, 3, 3, 0]  # a host of one rank keeps all its neighbour's copies
    assert buddies(["h"] * 3) == [1, 2, 0] and wards(buddies(["h"] * 3), 0) == [2]


LAYOUTS = ["[0-3]: dup=4", "[0-3]: split(0)=4", "[0-3]: split(0)=2, dup=2", "[0-3]: dup=2, split(1)=2",
           "[0,1]: split(0)=2 | [2,3]: split(0)=2 ; hetero=dup", "[0,1]: dup=2 | [2,3]: split(1)=2 ; hetero=dup",
           "[0,1]: dup=2 | [2]: dup=1 | [3]: dup=1 ; hetero=split(0), shares=2:1:1", "[0-3]: split(0)=2, split(1)=2"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(LAYOUTS), min_size=1, max_size=4), st.sampled_from(
    [["h"] * 4, ["a", "a", "b", "b"], ["a", "b", "a", "b"], ["a", "a", "a", "b"]]))
def test_every_region_outlives_any_one_rank_and_any_one_host(layouts, hosts):
    leaves = [Leaf(f"t{i}", i, (8, 12), parse_layout(text), "float32") for i, text in enumerate(layouts)]
    buddy = buddies(hosts)
    kept = {r: kept_pieces(leaves, r, hosts) for r in range(4)}
    for leaf in leaves:
        for region, devices in holders(leaf).items():
            keepers = [r for r in range(4) for p in kept[r] if p.name == leaf.name and p.region == region]
            copied = [p.copied for r in keepers for p in kept[r] if p.name == leaf.name and p.region == region]
            one_host = len({hosts[d] for d in devices}) == 1 and len(set(hosts)) > 1
            assert keepers and all(c == (len(devices) == 1 or one_host) for c in copied)
            assert len(keepers) == (1 if copied[0] else 2)  # replicas on several hosts: two keep it, no copy
            # where it survives each loss: a keeper left, or the lost keeper's buddy (for a copied piece)
            for gone in [{r} for r in range(4)] + [{r for r in range(4) if hosts[r] == h} for h in set(hosts)]:
                if len(gone) == 4:
                    continue
                left = [k for k in keepers if k not in gone]
                saved = [buddy[k] for k in keepers if copied[0] and buddy[k] not in gone]
                assert left or saved, (leaf.layout, region, gone)


def test_a_cover_takes_overlapping_pieces_each_adding_something():
    from hspmd.runtime.launcher.peer.recovery import cover

    whole, top, bottom = ((0, 8), (0, 4)), ((0, 4), (0, 4)), ((4, 8), (0, 4))
    # hetero dup: one group holds the tensor whole, another in halves; the whole one lost
    assert cover([8, 4], [(top, "a"), (bottom, "b")]) == [(top, "a"), (bottom, "b")]
    assert cover([8, 4], [(whole, "w"), (top, "a"), (bottom, "b")]) == [(whole, "w")]
    assert cover([8, 4], [(top, "a"), (whole, "w"), (bottom, "b")]) == [(top, "a"), (whole, "w")]
    assert cover([8, 4], [(top, "a")]) is None
    assert cover([], [((), "s")]) == [((), "s")] and cover([], []) is None


# -- copies, recovery and restore on in-process ranks -------------------------------------------

def _bundle(tmp, strategy: str, n: int, name: str) -> str:
    from hspmd.compiler import compile_script, write_bundle
    from hspmd.frontend.script import load_script

    path = str(tmp / name)
    write_bundle(compile_script(load_script(MLP, {}), strategy, n), path)
    return path


def _train(bundle: str, n: int, steps: int, **kw):
    from hspmd.runtime.comm.inprocess import InProcessCommunicator
    from hspmd.runtime.worker import train

    comms = InProcessCommunicator.create_world(n)
    out = [None] * n
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, train(bundle, comms[r], steps=steps,
                                                                          quiet=True, **kw))) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """An MLP under tp=3 (every piece held once: copies to buddies) trained 4 steps with copies
    on in-process ranks of two simulated hosts; the 2-rank bundle to restore into."""
    tmp = tmp_path_factory.mktemp("peer")
    three, two = _bundle(tmp, "[0-2]: tp=3", 3, "b3"), _bundle(tmp, "[0,1]: dp=2", 2, "b2")
    peer_dir = str(tmp / "gen-0")
    os.environ["HSPMD_HOSTS"] = "a,a,b"
    try:
        first = _train(three, 3, 4, peer=PeerOptions(directory=peer_dir))
    finally:
        del os.environ["HSPMD_HOSTS"]
    yield tmp, three, two, peer_dir, first
    remove_shm(peer_dir)


def test_a_lost_rank_is_recovered_from_its_buddy_and_training_goes_on_bit_for_bit(copied):
    tmp, three, two, peer_dir, _ = copied
    recovery, why = plan_recovery(peer_dir, {1})
    assert recovery is not None and recovery.step == 4 and why == ""
    assert recovery.sources["buddy"] > 0  # rank 1's tp shards come from its buddy's copy
    path = str(tmp / "recovery.json")
    write_recovery(recovery, path)
    assert read_recovery(path).tensors == recovery.tensors
    os.environ["HSPMD_HOSTS"] = "b,a"  # each new rank reads its host's pieces and asks for the other's
    try:
        resumed = _train(two, 2, 7, peer=PeerOptions(restore=path))
    finally:
        del os.environ["HSPMD_HOSTS"]
    assert resumed[0].first_step == 5
    # the same run switched by hand: 4 steps on 3 ranks, a checkpoint, 3 more on 2 ranks from it
    from hspmd.runtime.worker import CheckpointOptions

    ck = str(tmp / "ck")
    first = _train(three, 3, 4, checkpoints=CheckpointOptions(directory=ck, every=4))
    by_hand = _train(two, 2, 7, checkpoints=CheckpointOptions(resume=ck))
    assert first[0].losses == copied[4][0].losses  # making the copies did not change the training
    assert resumed[0].losses == by_hand[0].losses
    for name, value in by_hand[0].params.items():
        assert np.array_equal(resumed[0].params[name], value), name


#: one strategy per family: plain replicas (no copy needed), tp shards, pp stages, zero=3 shards, unlike groups
FAMILIES = ["[0-2]: dp=3", "[0-2]: tp=3", "[0-2]: pp=3", "[0-2]: dp=3 zero=3", "[0,1]: tp=2 | [2]: tp=1"]


@pytest.mark.parametrize("strategy", FAMILIES)
def test_each_family_goes_on_from_the_copies_as_from_a_checkpoint_bit_for_bit(tmp_path, strategy, copied):
    """3 in-process ranks train 4 steps with copies (and a checkpoint at step 4); rank 1 lost, the
    2 left resume from the copies, and train as a switch through the checkpoint does, bit for bit."""
    from hspmd.runtime.worker import CheckpointOptions

    two = copied[2]
    three, peer_dir, ck = _bundle(tmp_path, strategy, 3, "b3"), str(tmp_path / "gen-0"), str(tmp_path / "ck")
    try:
        _train(three, 3, 4, peer=PeerOptions(directory=peer_dir), checkpoints=CheckpointOptions(directory=ck, every=4))
        recovery, why = plan_recovery(peer_dir, {1})
        assert recovery is not None and recovery.step == 4, why
        path = str(tmp_path / "recovery.json")
        write_recovery(recovery, path)
        resumed = _train(two, 2, 6, peer=PeerOptions(restore=path))
    finally:
        remove_shm(peer_dir)
    by_hand = _train(two, 2, 6, checkpoints=CheckpointOptions(resume=ck))
    assert resumed[0].first_step == 5 and resumed[0].losses == by_hand[0].losses
    for name, value in by_hand[0].params.items():
        assert np.array_equal(resumed[0].params[name], value), name


def test_the_loss_of_a_rank_and_its_buddy_is_said_in_one_line(copied):
    _, _, _, peer_dir, _ = copied
    recovery, why = plan_recovery(peer_dir, {0, 2})  # 0's buddy is 2 (hosts a, a, b)
    assert recovery is None and "and the buddy keeping a copy were lost" in why


def test_pieces_on_another_host_are_fetched_from_a_rank_there(copied):
    from hspmd.runtime.comm.inprocess import InProcessCommunicator

    tmp, _, _, peer_dir, _ = copied
    recovery, _ = plan_recovery(peer_dir, {1})
    leaves = [Leaf(name, i, tuple(t["shape"]), parse_layout("[0,1]: dup=2" if len(t["shape"]) < 2 else
                                                            "[0,1]: split(1)=2"), t["dtype"])
              for i, (name, t) in enumerate(sorted(recovery.tensors.items()))]
    comms = InProcessCommunicator.create_world(2)
    out: dict = {}

    def load(rank, hosts):
        out[hosts, rank] = load_peer_state(recovery, leaves, comms[rank], host=hosts[rank])

    for hosts in (("a", "b"), ("b", "a")):  # each rank reads its host's pieces, asks the other for the rest
        threads = [threading.Thread(target=load, args=(r, hosts)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for rank in range(2):
        local, fetched = out[("a", "b"), rank], out[("b", "a"), rank]
        assert sorted(local) == sorted(fetched)
        assert all(np.array_equal(local[k], fetched[k]) for k in local)


def test_a_piece_on_a_host_no_rank_is_on_is_an_error_on_every_rank(copied):
    from hspmd.runtime.comm.inprocess import InProcessCommunicator

    _, _, _, peer_dir, _ = copied
    recovery, _ = plan_recovery(peer_dir, {1})
    name, t = next((k, v) for k, v in recovery.tensors.items() if any(p["host"] == "b" for p in v["pieces"]))
    leaves = [Leaf(name, 0, tuple(t["shape"]), parse_layout("[0]: dup=1"), t["dtype"])]
    with pytest.raises(PeerRestoreError, match="on host b, where no rank of the run is now"):
        load_peer_state(recovery, leaves, InProcessCommunicator.create_world(1)[0], host="a")


def test_the_restart_line_of_the_log():
    record = {"lost_ranks": [1], "resumed_from_step": 21, "steps_redone": 1, "source": "peer", "last_step_at": 100.0}
    assert json.loads(restart_line(record, now=101.25)) == {
        "event": "restart", "lost_ranks": [1], "resumed_from_step": 21, "steps_redone": 1, "restart_s": 1.25,
        "source": "peer"}


# -- kill -9 through the elastic launcher, one run per strategy family ------------------------

@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    (ref,) = _train(_bundle(tmp_path_factory.mktemp("ref"), "[0]: dp=1", 1, "b1"), 1, 8)
    return dict(enumerate(ref.losses, start=1))


def _hspmd(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "HSPMD_FAULT"}
    proc = subprocess.run([os.path.join(BIN, "hspmd"), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**base, **(env or {})}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _rows(log) -> list[dict]:
    return [json.loads(line) for line in open(log) if line.startswith("{")]


def _losses(log) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(log) if "step" in r}


#: a launcher run takes ~10-30 s on 2 cores: each run kills a rank of one family, drawn anew
#: by the run's seed (HSPMD_KILL_SEED=S, or HSPMD_TEST_SEED, draws as run S did; every family is
#: recovered in process above, each run)
KILL_SEED = int(os.environ.get("HSPMD_KILL_SEED") or RUN_SEED)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", [random.Random(KILL_SEED).choice(FAMILIES)])
def test_kill_9_costs_at_most_one_step_and_keeps_the_one_device_losses(tmp_path, strategy, one_device):
    print(f"kill -9 under '{strategy}' (HSPMD_KILL_SEED={KILL_SEED} draws it again)")
    log = tmp_path / "e.jsonl"
    proc = _hspmd("run", "-n", "3", MLP, "--steps", "8", "--strategy", strategy, "--elastic", "--redundancy", "peer",
                  "--checkpoint-dir", str(tmp_path / "D"), "--checkpoint-every", "100", "--log", str(log),
                  env={"HSPMD_FAULT": "1:6"})
    said = [line for line in proc.stderr.splitlines() if line.startswith("hspmd run: ")]
    assert len(said) == 1 and "resuming from the peer copies of step" in said[0], proc.stderr
    (restart,) = [r for r in _rows(log) if r.get("event") == "restart"]
    assert restart["source"] == "peer" and restart["lost_ranks"] == [1]
    assert restart["resumed_from_step"] >= 4 and restart["steps_redone"] <= 1 and restart["restart_s"] > 0
    got = _losses(log)
    assert sorted(got) == list(range(1, 9))
    assert max(abs(got[s] - one_device[s]) / abs(one_device[s]) for s in got) <= 1e-5
    for gen in range(3):  # the launcher removed the copies from host memory at the end
        assert not os.path.exists(shm_directory(str(tmp_path / "D" / ".peer" / f"gen-{gen}")))


@pytest.mark.mpi
def test_a_rank_silent_past_silent_after_is_killed_and_counted_as_lost(tmp_path):
    log = tmp_path / "e.jsonl"
    proc = _hspmd("run", "-n", "2", MLP, "--steps", "6", "--elastic", "--redundancy", "peer", "--silent-after", "4",
                  "--checkpoint-dir", str(tmp_path / "D"), "--log", str(log), env={"HSPMD_FAULT": "1:4:stop"})
    said = [line for line in proc.stderr.splitlines() if line.startswith("hspmd run: ")]
    assert len(said) == 1 and said[0].startswith("hspmd run: rank 1 fell silent at step ~4 (no heartbeat for 4 s: "
                                                  "killed); resuming from the peer copies of step"), proc.stderr
    (restart,) = [r for r in _rows(log) if r.get("event") == "restart"]
    assert restart["lost_ranks"] == [1] and restart["source"] == "peer" and restart["steps_redone"] <= 1
    assert sorted(_losses(log)) == list(range(1, 7))


def test_the_planner_counts_the_copies_host_memory():
    from types import SimpleNamespace

    from hspmd.planner.cost import GroupConfig
    from hspmd.planner.redundancy import copies_bytes

    facts = SimpleNamespace(param_bytes=600.0, state_bytes=1200.0)
    group = lambda **kw: GroupConfig(devices=tuple(range(kw.pop("n"))), **kw)  # noqa: E731
    # dp=3: everything replicated, kept by 2 of 3 ranks, copied nowhere: 2 slots x 2/3 x 1800
    assert copies_bytes(facts, group(n=3, dp=3, tp=1, pp=1)) == 2 * 2 / 3 * 1800
    # zero=1: the states held alone (kept and copied to the buddy), the parameters replicated
    assert copies_bytes(facts, group(n=3, dp=3, tp=1, pp=1, zero=1)) == 2 * (2 * 400 + 2 * 600 / 3)
    # tp=3: every piece held alone: two slots of its own third and two of its ward's
    assert copies_bytes(facts, group(n=3, dp=1, tp=3, pp=1)) == 2 * 2 * 600


def test_no_room_for_the_copies_is_one_error_on_every_rank(tmp_path, monkeypatch):
    import errno

    from hspmd.runtime.worker import RunError

    bundle = _bundle(tmp_path, "[0,1]: tp=2", 2, "b")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    errors = []

    def run(comm):
        from hspmd.runtime.worker import train

        try:
            train(bundle, comm, steps=1, quiet=True, peer=PeerOptions(directory=str(tmp_path / "gen-0")))
        except RunError as err:
            errors.append(str(err))

    from hspmd.runtime.comm.inprocess import InProcessCommunicator

    comms = InProcessCommunicator.create_world(2)
    threads = [threading.Thread(target=run, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 2 and all("--redundancy peer: rank" in e and "No space left on device" in e for e in errors)
    remove_shm(str(tmp_path / "gen-0"))


def test_a_rank_and_its_buddy_lost_go_back_to_the_disk_in_one_line(copied, tmp_path, capsys, monkeypatch):
    import argparse
    import shutil
    import signal

    from hspmd.cli.elastic import _Run
    from hspmd.runtime.launcher.watch import RankEnd

    _, _, _, peer_dir, _ = copied
    d = tmp_path / "D"
    (d / "step-2").mkdir(parents=True)
    (d / "step-2" / "manifest.json").write_text("{}")  # a checkpoint of step 2 (its step: below)
    args = argparse.Namespace(checkpoint_dir=str(d), log=None, max_restarts=3, fallback_strategy=[], n=3,
                              strategy="[0-2]: tp=3", resume=None, init_from=None, redundancy=1, silent_after=None,
                              hosts=None, hostfile=None)
    run = _Run(args, None, None)
    shutil.copytree(peer_dir, d / ".peer" / "gen-0")
    lost = (RankEnd(0, "a", 1, -signal.SIGKILL, False), RankEnd(2, "b", 2, -signal.SIGKILL, False))
    monkeypatch.setattr("hspmd.cli.elastic.checkpoint_step", {str(d / "step-2"): 2}.__getitem__)
    run.after_loss(lost)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("hspmd run: ")]
    assert line.startswith("hspmd run: ranks 0, 2 died (SIGKILL); no step of the peer copies left holds all of '")
    assert f"(ranks 0, 2 and the buddy keeping a copy were lost): resuming from {d / 'step-2'} on 1 rank" in line
    assert run.record["source"] == "disk" and run.record["resumed_from_step"] == 2 and run.recovery is None


@pytest.mark.parametrize("text, elastic, message", [
    ("peer", False, "--redundancy needs --elastic (the copies are what its restarts resume from)"),
    ("peer:0", True, "--redundancy peer:0: expected peer or peer:K"),
    ("peer:x", True, "--redundancy peer:x: expected peer or peer:K"),
    ("disk", True, "--redundancy disk: expected peer or peer:K"),
])
def test_a_bad_redundancy_is_refused(text, elastic, message):
    from hspmd.cli.elastic import parse_redundancy

    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_redundancy(text, elastic)


def test_redundancy_spellings():
    from hspmd.cli.elastic import parse_redundancy

    assert parse_redundancy(None, False) is None
    assert parse_redundancy("peer", True) == 1 and parse_redundancy("peer:3", True) == 3


def test_a_bad_redundancy_from_the_command_line_is_one_line(tmp_path):
    from conftest import run_cli

    proc = run_cli("hspmd", "run", "-n", "2", MLP, "--steps", "1", "--elastic", "--checkpoint-dir",
                   str(tmp_path / "ck"), "--redundancy", "peer:0", timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--redundancy peer:0: expected peer or peer:K" in lines[0], proc.stderr
