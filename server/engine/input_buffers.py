"""Preallocated step state: named arrays in one host buffer (pinned on CUDA), mirrored by one
device buffer. A step fills the host side through numpy views, then one copy moves all of it; on the
CPU the host buffer is the device buffer and nothing is copied."""

from __future__ import annotations

import numpy as np
import torch

_TORCH = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


class InputBuffers:
    def __init__(self, fields: dict[str, tuple[type, tuple[int, ...]]], device: torch.device) -> None:
        """fields: name -> (numpy dtype, shape)."""
        self.device, self.layout, offset = device, {}, 0
        for name, (dtype, shape) in fields.items():
            dtype = np.dtype(dtype)
            offset = -(-offset // 8) * 8  # 8-byte aligned, for every view's dtype
            self.layout[name] = (offset, dtype, shape)
            offset += int(np.prod(shape)) * dtype.itemsize
        self.nbytes = offset
        on_cuda = device.type == "cuda"
        self._host = torch.zeros(offset, dtype=torch.uint8, pin_memory=on_cuda)
        self._device = torch.zeros(offset, dtype=torch.uint8, device=device) if on_cuda else self._host
        self.host = {name: self._view(self._host.numpy(), name) for name in self.layout}
        self.tensors = {name: self._tensor(self._device, name) for name in self.layout}
        self._copied = torch.cuda.Event() if on_cuda else None  # the last upload's copy has left the host buffer

    def _view(self, raw: np.ndarray, name: str) -> np.ndarray:
        offset, dtype, shape = self.layout[name]
        return raw[offset : offset + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    def _tensor(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        offset, dtype, shape = self.layout[name]
        size = int(np.prod(shape)) * dtype.itemsize
        return raw[offset : offset + size].view(_TORCH[dtype]).view(shape)

    def wait_copied(self) -> None:
        """Before the host side is written again: the previous upload's copy must have read it."""
        if self._copied is not None:
            self._copied.synchronize()

    def upload(self) -> None:
        """The step's one host-to-device copy (nothing to do on the CPU)."""
        if self._device is not self._host:
            self._device.copy_(self._host, non_blocking=True)
            self._copied.record()
