"""GPTQ's view of a W4 weight: quantize-dequantize one column at a time, in
either checkpoint format (progressive groups or per channel), with the
numerics of qoq_ref; the offline quantizer's, not the runtime's."""
import torch

from qoqserve.kernels.qoq_ref import (
    PROTECT,
    QWeightChannel,
    QWeightGroup,
    channel_params,
    level1_codes,
    level1_scale,
    level2_params,
)


class WeightQuantizer:
    """Quantize-dequantize one column at a time, for either format.

    Row scales (s1, and z in channel mode) are fixed from the original matrix;
    group params come from prepare_group(), called by GPTQ with the current
    error-compensated columns of that group (or all up front for static groups).
    Column indices are always those of the original matrix.
    """

    def __init__(self, w: torch.Tensor, group_size: int = 0, clip=None, group_params=None):
        n, k = w.shape
        self.group_size = int(group_size or 0)
        # optional (level-1 values [N, g], first column) -> (s2, z): the offline
        # quantizer's error search; None = round-to-nearest ranges (level2_params)
        self.group_params = group_params
        if self.group_size:
            if k % self.group_size:
                raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
            self.s1 = level1_scale(w, clip)
            self.s2 = torch.ones(n, k // self.group_size, device=w.device)
            self.z = torch.zeros(n, k // self.group_size, device=w.device)
        else:
            self.s1, self.z = channel_params(w, clip)
        self._s1f = self.s1.float()
        self.u = torch.zeros(n, k, dtype=torch.uint8, device=w.device)

    def prepare_group(self, col: int, w_cols: torch.Tensor) -> None:
        if not self.group_size:
            return
        if col % self.group_size or w_cols.shape[1] != self.group_size:
            raise ValueError("prepare_group must get one whole, aligned group")
        if self.group_params is not None:
            s2, z = self.group_params(w_cols.float() / self._s1f[:, None], col)
        else:
            s2, z, _ = level2_params(level1_codes(w_cols, self.s1))
        self.s2[:, col // self.group_size] = s2
        self.z[:, col // self.group_size] = z

    def prepare_all_groups(self, w: torch.Tensor) -> None:
        for c in range(0, w.shape[1], self.group_size or w.shape[1] + 1):
            self.prepare_group(c, w[:, c:c + self.group_size])

    def quant_dequant(self, col: int, x: torch.Tensor) -> torch.Tensor:
        """Quantize column `col` (values x [N]); records its codes, returns fp32 x_hat."""
        s1 = self._s1f
        if self.group_size:
            g = col // self.group_size
            s2, z = self.s2[:, g], self.z[:, g]
            q1 = torch.clamp(torch.round(x.float() / s1), -PROTECT, PROTECT)
            u = torch.clamp(torch.round(q1 / s2) + z, 0, 15)
            self.u[:, col] = u.to(torch.uint8)
            return s1 * (s2 * (u - z))
        u = torch.clamp(torch.round(x.float() / s1) + self.z, 0, 15)
        self.u[:, col] = u.to(torch.uint8)
        return s1 * (u - self.z)

    def quantize_all(self, w: torch.Tensor):
        """Round-to-nearest with this quantizer's group params (no error feedback):
        quant_dequant of every column, as one elementwise pass (same bits)."""
        self.prepare_all_groups(w)
        x = w.float() / self._s1f[:, None]
        if self.group_size:
            s2 = self.s2.repeat_interleave(self.group_size, dim=1)
            z = self.z.repeat_interleave(self.group_size, dim=1)
            u = torch.clamp(torch.round(torch.clamp(torch.round(x), -PROTECT, PROTECT) / s2) + z, 0, 15)
        else:
            u = torch.clamp(torch.round(x) + self.z[:, None], 0, 15)
        self.u.copy_(u.to(torch.uint8))
        return self.result()

    def result(self):
        if self.group_size:
            return QWeightGroup(self.s1, self.s2.to(torch.uint8), self.z.to(torch.uint8),
                                self.u, self.group_size)
        return QWeightChannel(self.s1, self.z.to(torch.uint8), self.u)
