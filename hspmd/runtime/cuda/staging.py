"""Batches made into the device's host buffers (page-locked memory under CUDA), for the upload that
the GPU plan queues behind the running step (`DevicePlan.run`'s `ahead`).

The data feed makes each batch in a background thread; `HostStaging` copies it there into a
ring of host buffers per input, `prefetch + 3` deep. A buffer is written again only after that
many more batches, and by then the upload of the batch it held has finished: a batch is uploaded
at the latest during the step before its own, which ends by reading its outputs back (a
synchronisation), and the feed makes at most `prefetch` batches ahead of the one being trained on.
"""

from __future__ import annotations

import numpy as np

from hspmd.runtime.cuda.device import Device

__all__ = ["HostStaging"]


class HostStaging:
    """`staging(inputs) -> inputs`: each array copied into the next buffer of its ring (see the module docstring)."""

    def __init__(self, device: Device, prefetch: int) -> None:
        self.device, self.slots = device, max(int(prefetch), 0) + 3
        self._rings: dict[tuple, list[np.ndarray]] = {}
        self._turn = 0

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        slot = self._turn % self.slots
        for name, value in inputs.items():
            value = np.asarray(value)
            ring = self._rings.setdefault((name, value.shape, value.dtype.str), [])
            while len(ring) <= slot:
                ring.append(self.device.host_buffer(value.nbytes))
            view = ring[slot][:value.nbytes].view(value.dtype).reshape(value.shape)
            np.copyto(view, value)
            out[name] = view
        self._turn += 1
        return out
