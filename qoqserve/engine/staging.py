"""A step's small host-side inputs (token ids, positions, slots, context
lengths, block tables) on their way to the device.

On CUDA they go through persistent pinned host buffers, one per input, grown
when a step needs more, and are copied with non_blocking=True: no pageable
copy, no stream sync per input, no allocation per step. Reusing a buffer in
the next step is safe because every step ends in the sampler's .tolist(),
which waits for the stream. On CPU the tensor is simply made.
"""
from __future__ import annotations

import torch


class HostStaging:
    def __init__(self, device: torch.device):
        self.device = device
        # persistent buffers where a copy must not be pageable (CUDA)
        self.persistent = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, n: int) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n:
            size = max(n, 2 * (buf.numel() if buf is not None else 256))
            buf = self._buffers[name] = torch.empty(size, dtype=torch.long,
                                                    pin_memory=self.device.type == "cuda")
        return buf

    def put(self, name: str, values: list[int], shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """values (flat) as a long tensor of `shape` (default: 1-D) on the device."""
        shape = shape or (len(values),)
        if not self.persistent:
            return torch.tensor(values, dtype=torch.long, device=self.device).view(shape)
        buf = self._buffer(name, len(values))[:len(values)]
        buf.copy_(torch.tensor(values, dtype=torch.long))
        return buf.view(shape).to(self.device, non_blocking=True)
