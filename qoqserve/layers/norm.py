import torch
from torch import nn

from qoqserve.layers.token_ops import TorchTokenOps


class RMSNorm(nn.Module):
    """RMSNorm over the model's token ops (layers/token_ops.py); given `delta`,
    the residual add before it is fused: returns (norm(h + delta), h + delta)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, ops=None):
        super().__init__()
        self.eps = eps
        self.ops = ops or TorchTokenOps()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None):
        if delta is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, delta, self.weight, self.eps)
