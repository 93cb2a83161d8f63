"""`hspmd profile -n 1 --device cuda`: a GPU rank's compute rates, measured through the plan's device.

On the emulated device (the test switch `HSPMD_EMULATE_GPU=1`) the measurement runs as on a GPU:
GEMMs through the device's GEMM call, the exp and softmax kernels as `device-kernels` makes
them, batches of calls between synchronisations. Without a GPU, `--device cuda` is one line
and exit 2.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import run_cli

from hspmd.ir.device_profile import DeviceProfile
from hspmd.runtime.cuda.emulated import EmulatedDevice
from hspmd.runtime.cuda.profile import describe, device_rates


def test_device_rates_on_the_emulated_device():
    rates = device_rates(EmulatedDevice(), 0.02, shapes=((8, 16, 8, 16), (64, 64, 64), (128, 128, 128)), size=1 << 16)
    assert [p.shape for p in rates.matmul] == [(8, 16, 8, 16), (64, 64, 64), (128, 128, 128)]
    assert all(p.gflops > 0 for p in rates.matmul) and rates.elementwise_bps > 0 and rates.fused_bps > 0
    assert describe(rates).startswith("matmul up to ")


def test_profile_device_cuda_writes_the_gpu_rates(tmp_path):
    out = tmp_path / "gpu.json"
    r = run_cli("hspmd", "profile", "-n", "1", "--device", "cuda", "-o", str(out), "--seconds-per-point", "0.01",
                env={"HSPMD_EMULATE_GPU": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    profile = DeviceProfile.load(str(out))
    assert "emulated GPU" in profile.source and len(profile.ranks[0].matmul) == 8
    assert json.loads(out.read_text())["meta"]["devices"] == [EmulatedDevice.name]


def test_profile_device_cuda_without_a_gpu_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HSPMD_EMULATE_GPU"}
    r = run_cli("hspmd", "profile", "-n", "1", "--device", "cuda", "-o", str(tmp_path / "p.json"), env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--device cuda: no usable GPU here" in r.stderr
    r = run_cli("hspmd", "profile", "-n", "2", "--device", "cuda,gpu", "-o", str(tmp_path / "p.json"),
                env={"HSPMD_EMULATE_GPU": "1"})
    assert r.returncode == 2 and "unknown device 'gpu'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
def test_profile_device_cuda_on_a_gpu(tmp_path):
    from hspmd.codegen.cupy_backend import gpu_status

    ok, why = gpu_status()
    if not ok:
        pytest.skip(f"needs CuPy and a CUDA GPU: {why}")
    out = tmp_path / "gpu.json"
    r = run_cli("hspmd", "profile", "-n", "1", "--device", "cuda", "-o", str(out), timeout=300)
    assert r.returncode == 0, r.stderr
    rates = DeviceProfile.load(str(out)).ranks[0]
    print(r.stdout)
    assert max(p.gflops for p in rates.matmul) > 1000 and rates.elementwise_bps > 100e9
