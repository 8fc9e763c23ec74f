"""Passes of one decoder layer over the calibration activations: the whole
layer a few samples at a time (run_layer, optionally stopped at a linear
whose inputs were wanted), and the true-sequential pass that quantizes the
layer's linears in order, each from the inputs the quantized ones before it
produce (sequential_layer)."""
from __future__ import annotations

import torch

from qoqserve.layers.attention import AttentionMetadata
from qoqserve.quant.config import LINEARS
from qoqserve.quant.layer_stats import LayerCapture


def _meta(lengths: tuple[int, ...]) -> AttentionMetadata:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return AttentionMetadata(True, None, None, None, starts, [0] * len(lengths))


class _StopForward(Exception):
    """Raised by a pre-hook once the linear whose inputs were wanted has them."""


def _stop(module, args):
    raise _StopForward


def _row_chunks(lengths: tuple[int, ...], chunk: int = 8):
    """(the chunk's sample lengths, its token rows), a few samples at a time;
    lengths: every calibration sample's, in the order their rows lie."""
    start = 0
    for s in range(0, len(lengths), chunk):
        part = lengths[s:s + chunk]
        yield part, slice(start, start + sum(part))
        start += sum(part)


def run_layer(layer, hidden: torch.Tensor, lengths: tuple[int, ...],
              stop_at: str | None = None) -> torch.Tensor | None:
    """hidden [sum(lengths), h] through one decoder layer, a few samples at a time.
    stop_at: a linear's name: each chunk's forward ends when it reaches that
    linear (its inputs go to the hooks registered before this call), and
    nothing is returned."""
    out = None if stop_at else torch.empty_like(hidden)
    handle = layer.get_submodule(stop_at).register_forward_pre_hook(_stop) if stop_at else None
    try:
        for part, rows in _row_chunks(lengths):
            positions = torch.cat([torch.arange(n, device=hidden.device) for n in part])
            try:
                h, delta = layer(positions, hidden[rows], _meta(part), None)
            except _StopForward:
                continue
            out[rows] = h + delta
    finally:
        if handle is not None:
            handle.remove()
    return out


def fp_layer_inputs(layer, hidden: torch.Tensor, lengths: tuple[int, ...], names=LINEARS):
    """The FP model's own pass through one still-unquantized layer: its exact
    KV (no cache quantization) and every named linear's inputs [T, K], in
    token order. Returns (output, {name: inputs})."""
    store = {n: [] for n in names}
    hooks = [layer.get_submodule(n).register_forward_pre_hook(
        lambda module, args, n=n: store[n].append(args[0].detach().float().reshape(-1, args[0].shape[-1])))
        for n in names]
    backend = layer.self_attn.attn.backend
    lossy, backend.quantized_prefill = backend.quantized_prefill, False
    try:
        out = run_layer(layer, hidden, lengths)
    finally:
        backend.quantized_prefill = lossy
        for h in hooks:
            h.remove()
    return out, {n: torch.cat(parts) for n, parts in store.items()}


def transformed_statistics(layer, hidden: torch.Tensor, lengths: tuple[int, ...], arch,
                           cap: LayerCapture) -> None:
    """Asymmetric calibration's Hessians and cross products, from a pass of the
    layer as its transforms left it (smoothed, reordered, keys centred and
    rotated), so the quantized model's inputs carry the KV4 error it will
    really have, not that of the raw keys the measuring pass quantized; the FP
    inputs (cap.targets) already follow the same permutations and scales."""
    again = LayerCapture(layer, LINEARS, arch, hessians=True, skip_outputs=LINEARS[-1:], targets=cap.targets)
    with again:
        run_layer(layer, hidden, lengths)
    cap.hessians, cap.cross = again.hessians, again.cross


def sequential_layer(layer, hidden: torch.Tensor, lengths: tuple[int, ...], arch, hessians: bool,
                      first: LayerCapture, quantize) -> torch.Tensor:
    """Quantize the layer's linears in order (quantize(name, capture)), each from
    the inputs that the already-quantized ones before it produce, and return
    the layer's output. Each stage keeps its linear's inputs, so the layer runs
    once in all: the decoder layer's forward, cut at its linears."""
    attn, mlp = layer.self_attn, layer.mlp
    quantize(LINEARS[0], first)
    kept = []
    keep = attn.o_proj.register_forward_pre_hook(lambda module, args: kept.append(args[0].detach()))
    cap = LayerCapture(layer, [LINEARS[1]], arch, hessians=hessians)
    try:
        with cap:
            run_layer(layer, hidden, lengths, stop_at=LINEARS[1])
    finally:
        keep.remove()
    quantize(LINEARS[1], cap)
    x_attn = torch.cat(kept)
    residual, x_mlp, x_down = torch.empty_like(hidden), torch.empty_like(hidden), None

    def post_attention(rows):
        a = attn.o_proj(x_attn[rows])
        if layer.sandwich:  # Gemma: the attention's output normalized before the residual add
            a = layer.post_attention_layernorm(a)
        x, residual[rows] = mlp.gate_up_proj.input_from_norm(layer.mlp_input_norm, hidden[rows], a)
        x_mlp[rows] = x
        return x

    def gate_up(rows):
        nonlocal x_down
        if mlp.gelu:
            x = mlp.ops.gelu_mul(mlp.gate_up_proj(x_mlp[rows]))
        else:
            x = mlp.down_proj.input_from_silu_mul(mlp.gate_up_proj(x_mlp[rows]), mlp.ops.silu_mul)
        if x_down is None:
            x_down = x.new_empty(hidden.shape[0], x.shape[-1])
        x_down[rows] = x
        return x

    for name, make_input in ((LINEARS[2], post_attention), (LINEARS[3], gate_up)):
        linear = layer.get_submodule(name)
        cap = LayerCapture(layer, [name], arch, hessians=hessians)
        with cap:
            stop = linear.register_forward_pre_hook(_stop)
            try:
                for _, rows in _row_chunks(lengths):
                    try:
                        linear(make_input(rows))
                    except _StopForward:
                        pass
            finally:
                stop.remove()
        quantize(name, cap)
    out = torch.empty_like(hidden)
    for _, rows in _row_chunks(lengths):
        m = mlp.down_proj(x_down[rows])
        out[rows] = residual[rows] + (layer.post_feedforward_layernorm(m) if layer.sandwich else m)
    return out
