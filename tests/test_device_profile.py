"""The device profile: its model of compute and communication, JSON round trips, malformed files."""

from __future__ import annotations

import json

import pytest

from hspmd.ir.device_profile import (
    COLLECTIVES, CollectiveFit, DeviceProfile, Link, MatmulPoint, ProfileError, RankRates, ring_seconds,
)


def _measured() -> DeviceProfile:
    rates = RankRates((MatmulPoint(2e6, 10.0, (100, 100, 100)), MatmulPoint(2e9, 50.0, (1000, 1000, 1000))),
                      8e9, 20e9)
    return DeviceProfile(
        (rates, rates.scaled(0.5), rates), Link(50e-6, 1e9),
        {(0, 1): Link(5e-6, 10e9), (1, 0): Link(5e-6, 10e9)},
        (CollectiveFit("all_reduce", (0, 1, 2), 100e-6, 2e9), CollectiveFit("all_gather", (0, 1), 10e-6, 4e9)),
        source="test", meta={"reps": 3},
    )


def test_json_round_trip_keeps_every_number(tmp_path):
    prof = _measured()
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = DeviceProfile.load(str(path))
    assert back == prof
    data = json.loads(path.read_text())
    assert data["format"] == "hspmd-device-profile" and data["version"] == 1
    assert DeviceProfile.uniform(4, speed=[1, 2, 1, 0.5]).to_json() == \
        DeviceProfile.from_json(DeviceProfile.uniform(4, speed=[1, 2, 1, 0.5]).to_json()).to_json()


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    ('{"ranks": []}', "not a device profile"),
    ('{"format": "hspmd-device-profile", "version": 7}', "version 7 is not supported"),
    ('{"format": "hspmd-device-profile", "version": 1, "ranks": [{"matmul": []}]}', "missing field"),
    ('{"format": "hspmd-device-profile", "version": 1, "ranks": [], '
     '"default_link": {"latency_s": 0, "bandwidth_bps": 1}}', "at least one rank"),
    ('{"format": "hspmd-device-profile", "version": 1, "ranks": [{"matmul": [{"flops": 1, "gflops": -3}], '
     '"elementwise_bps": 1}], "default_link": {"latency_s": 0, "bandwidth_bps": 1}}', "not positive"),
    ('{"format": "hspmd-device-profile", "version": 1, "ranks": [{"matmul": [{"flops": 1, "gflops": 3}], '
     '"elementwise_bps": 1}], "default_link": {"latency_s": 0, "bandwidth_bps": 1}, '
     '"collectives": [{"kind": "gossip", "group": [0], "latency_s": 0, "bandwidth_bps": 1}]}', "unknown collective"),
    ('{"format": "hspmd-device-profile", "version": 1, "ranks": [{"matmul": [{"flops": 1, "gflops": 3}], '
     '"elementwise_bps": 1}], "default_link": {"latency_s": 0, "bandwidth_bps": 1}, '
     '"links": [{"src": 0, "dst": 4, "latency_s": 0, "bandwidth_bps": 1}]}', "outside 0..0"),
    ('{"format": "hspmd-device-profile", "version": 1, "ranks": "x", '
     '"default_link": {"latency_s": 0, "bandwidth_bps": 1}}', "malformed"),
])
def test_malformed_files_give_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=message) as err:
        DeviceProfile.load(str(path))
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_matmul_rate_is_interpolated_by_flops_and_clamped():
    prof = _measured()
    r = prof.rates(0)
    assert r.matmul_gflops(1e3) == 10.0 and r.matmul_gflops(1e12) == 50.0
    mid = r.matmul_gflops(2e6 * 10 ** 1.5)  # halfway in log(FLOPs)
    assert mid == pytest.approx(30.0)
    assert prof.matmul_seconds(1, 2e9) == pytest.approx(2 * prof.matmul_seconds(0, 2e9))  # rank 1 at half speed
    assert prof.fused_seconds(0, 20e9) == pytest.approx(1.0)
    assert prof.elementwise_seconds(0, 8e9) == pytest.approx(1.0)
    assert DeviceProfile.uniform(1).fused_seconds(0, 5e9) == pytest.approx(1.0)  # falls back to elementwise


def test_collective_model_falls_back_sensibly():
    prof = _measured()
    assert prof.time("all_reduce", [2, 1, 0], 2e6) == pytest.approx(100e-6 + 1e-3)  # measured, any order
    assert prof.time("all_reduce", [0], 1e9) == 0.0  # one rank moves nothing
    # all_gather over (0, 2): the fit of the measured pair (0, 1), slowed to the slower link 0-2
    fast, slow = prof.time("all_gather", [0, 1], 1e6), prof.time("all_gather", [0, 2], 1e6)
    assert slow > fast
    # broadcast over a pair: no fit at all, the ring over the pair's link
    assert prof.time("broadcast", [0, 1], 1e6) == pytest.approx(ring_seconds("broadcast", 2, 1e6, Link(5e-6, 10e9)))
    # a group with a slow link is slower than one without
    uni = DeviceProfile.uniform(4).with_link(0, 3, Link(1e-3, 1e8))
    for kind in COLLECTIVES:
        assert uni.time(kind, [0, 1, 2, 3], 4e6) > uni.time(kind, [0, 1, 2], 4e6) > 0
    with pytest.raises(ProfileError, match="unknown collective"):
        prof.time("gossip", [0, 1], 1)
    with pytest.raises(ProfileError, match="not rank 5"):
        prof.rates(5)


def test_ring_model_matches_the_usual_formulas():
    link = Link(1e-5, 1e9)
    assert ring_seconds("all_reduce", 4, 4e6, link) == pytest.approx(6 * (1e-5 + 1e-3))
    assert ring_seconds("all_gather", 4, 4e6, link) == pytest.approx(3 * (1e-5 + 1e-3))
    assert ring_seconds("all_reduce", 1, 4e6, link) == 0.0


def test_synthetic_profiles():
    prof = DeviceProfile.uniform(3, gflops=100, speed=[1, 1, 0.5])
    assert prof.num_ranks == 3 and prof.source.startswith("synthetic")
    assert prof.matmul_seconds(2, 1e9) == pytest.approx(2 * prof.matmul_seconds(0, 1e9))
    assert prof.with_speed([2, 1, 1]).matmul_seconds(0, 1e9) == pytest.approx(prof.matmul_seconds(0, 1e9) / 2)
    assert prof.restricted(2).num_ranks == 2
    assert "default CPU" in DeviceProfile.default_cpu(2).source
    for bad in (lambda: DeviceProfile.uniform(0), lambda: DeviceProfile.uniform(2, speed=[1]),
                lambda: DeviceProfile.uniform(2, speed=[1, 0]), lambda: prof.restricted(4)):
        with pytest.raises(ProfileError):
            bad()


def test_collective_points_are_interpolated_between_measured_sizes():
    # measured at 1 KiB, 64 KiB and 4 MiB: an algorithm switch between the last two makes one
    # alpha-beta line through the ends wrong in the middle; the points are followed instead
    fit = CollectiveFit.from_points("all_reduce", (0, 1), [(4 << 20, 4e-3), (1 << 10, 20e-6), (1 << 16, 30e-6)])
    assert [b for b, _ in fit.points] == [1 << 10, 1 << 16, 4 << 20]  # sorted by size
    assert fit.seconds(1 << 16) == pytest.approx(30e-6)
    assert fit.seconds(100) == pytest.approx(20e-6)  # below the smallest: its time (latency)
    mid = (1 << 10) + ((1 << 16) - (1 << 10)) / 2
    assert fit.seconds(mid) == pytest.approx(25e-6)  # linear between neighbours
    slope = (4e-3 - 30e-6) / ((4 << 20) - (1 << 16))
    assert fit.seconds(8 << 20) == pytest.approx(4e-3 + slope * (4 << 20))  # the last segment goes on
    line = CollectiveFit("all_reduce", (0, 1), fit.latency_s, fit.bandwidth_bps)  # through the two ends
    assert line.seconds(1 << 16) > 2 * fit.seconds(1 << 16)
    assert line.seconds(1 << 10) == pytest.approx(20e-6) and line.seconds(4 << 20) == pytest.approx(4e-3)


def test_collective_points_survive_json_and_bad_points_are_refused(tmp_path):
    fit = CollectiveFit.from_points("all_gather", (0, 1), [(1024, 1e-5), (1 << 20, 1e-3)])
    prof = DeviceProfile.uniform(2)
    prof = DeviceProfile(prof.ranks, prof.default_link, {}, (fit,))
    back = DeviceProfile.from_json(json.loads(json.dumps(prof.to_json())))
    assert back == prof and back.time("all_gather", [1, 0], 1 << 19) == pytest.approx(fit.seconds(1 << 19))
    old = prof.to_json()
    del old["collectives"][0]["points"]  # a profile written before points: the line
    assert DeviceProfile.from_json(old).collectives[0].points == ()
    bad = prof.to_json()
    bad["collectives"][0]["points"] = [[0, 1e-5], [1024, 2e-5]]
    with pytest.raises(ProfileError, match="distinct positive sizes"):
        DeviceProfile.from_json(bad)


def test_resync_cost_is_kept_looked_up_by_group_size_and_grows_with_the_compute_apart():
    fit = CollectiveFit.from_points("all_reduce", (0, 1), [(1024, 1e-5), (1 << 20, 1e-3)])
    fit = CollectiveFit(fit.kind, fit.group, fit.latency_s, fit.bandwidth_bps, fit.points, 2e-4, 1e-3)
    base = DeviceProfile.uniform(3)
    prof = DeviceProfile(base.ranks, base.default_link, {}, (fit,))
    assert DeviceProfile.from_json(json.loads(json.dumps(prof.to_json()))) == prof
    assert prof.resync_seconds("all_reduce", [1, 0], 1e-3) == 2e-4  # measured after 1 ms of compute
    assert prof.resync_seconds("all_reduce", [1, 0], 5e-3) == 2e-4  # at most that
    assert prof.resync_seconds("all_reduce", [1, 0], 0.25e-3) == pytest.approx(0.5e-4)  # less compute, less drift
    assert prof.resync_seconds("all_reduce", [0, 1], 0.0) == 0.0  # a burst: nothing computed between
    assert prof.resync_seconds("all_reduce", [1, 2], 1e-3) == 2e-4  # a pair like the measured one
    assert prof.resync_seconds("all_reduce", [0, 1, 2], 1e-3) == 0.0 == prof.resync_seconds("all_gather", [0, 1], 1)
    assert prof.resync_seconds("all_reduce", [0], 1.0) == 0.0
