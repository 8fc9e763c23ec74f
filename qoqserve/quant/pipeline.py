"""The QoQ pipeline, layer by layer over calibration activations.

rotate (whole model, weights only) -> for each decoder layer: measure ->
SmoothAttention -> reorder -> smooth (alpha searched) -> measure again ->
clip search + GPTQ per linear -> run the now-quantized layer to produce the
next layer's inputs. Only one layer's activations are alive at a time, on
top of the model and the calibration hidden states.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from qoqserve.kernels import qoq_ref
from qoqserve.kernels.cpu import prebuild
from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.kv_cache import DenseKVCacheLayout, Int4KVCacheLayout
from qoqserve.layers.quantization import QoQConfig
from qoqserve.models.llama import LlamaForCausalLM
from qoqserve.quant import layer_passes, sim
from qoqserve.quant.calibration import CalibrationSet
from qoqserve.quant.clip import search_clip_ratios
from qoqserve.quant.config import LINEARS, QuantConfig
from qoqserve.quant.gptq import asymmetric_target, gptq_quantize
from qoqserve.quant.group_search import search_group_params
from qoqserve.quant.layer_stats import LayerCapture, search_alpha, search_key_alpha
from qoqserve.quant.scale_tuning import ScaleTuning, spread_windows, tune_scales
from qoqserve.quant.transforms._common import expand_groups, group_max
from qoqserve.quant.transforms.key_center import center_and_rotate_keys, key_rotation
from qoqserve.quant.transforms.learned_rotation import learn_rotation
from qoqserve.quant.transforms.reorder import reorder_down, reorder_out_proj
from qoqserve.quant.transforms.rotation import fold_norms, rotate_model, rotate_values
from qoqserve.quant.transforms.smooth import (
    smooth_attention,
    smooth_down,
    smooth_input,
    smooth_out_proj,
    smooth_scales,
)
from qoqserve.quant.weight_quantizer import WeightQuantizer

log = logging.getLogger(__name__)

# Bumped whenever the same QuantConfig makes different numbers (a cached
# checkpoint of an older revision is quantized again). 2: the straight-through
# forward equals the fake quantization bit for bit (quant/ste.py).
QUANTIZER_REVISION = 2


@dataclass
class QuantResult:
    model: LlamaForCausalLM
    config: QuantConfig
    steps: list[str]
    layer_info: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    rotation_curve: list[float] = field(default_factory=list)  # learned rotation: loss per step
    scale_tuning: ScaleTuning | None = None


def build_fp_model(source, cfg: QuantConfig, device: str, max_positions: int = 4096) -> LlamaForCausalLM:
    """fp32 model; with KV4 every layer attends to fake-quantized K/V, prefill
    included. max_positions: the longest sequence it will run."""
    a = dataclasses.replace(source.arch)  # rotation unties lm_head: never mutate the source's arch
    if cfg.kv_bits == 4:
        attention = AttentionBackend(Int4KVCacheLayout(a.num_kv_heads, a.head_dim, 16), quantized_prefill=True)
    else:
        attention = AttentionBackend(DenseKVCacheLayout(a.num_kv_heads, a.head_dim, 16, torch.float32))
    with torch.device(device):
        model = LlamaForCausalLM(a, attention, torch.float32,
                                 max_positions=max(cfg.longest_calibration_window, max_positions),
                                 key_transform=cfg.uses_key_transform)
    # an FP source has no key transform: it starts as the identity it was built as
    identity = [(f"model.layers.{i}.self_attn.key_transform.{n}", p.detach().clone())
                for i, layer in enumerate(model.layers) if layer.self_attn.key_transform is not None
                for n, p in layer.self_attn.key_transform.named_parameters()]
    model.load_weights(itertools.chain(source.iter_tensors(), identity))
    return model.eval()


def _quantize_linear(linear, cap, cfg: QuantConfig, info: dict, name: str, key: str) -> None:
    w = linear.weight.detach().float()
    if cfg.keeps_w8a8(key):
        sim.convert_to_w8a8(linear, w)
        info[f"{name}.scheme"] = "w8a8"
        return
    if cfg.w_bits == 16:
        sim.convert_to_fake(linear, w, cfg.a_bits == 8, "fake-a8" if cfg.a_bits == 8 else "fp")
        return
    if not cfg.is_qoq_format and not (cfg.w_bits == 4 and cfg.progressive):
        label = f"fake-w{cfg.w_bits}a{cfg.a_bits}"
        sim.convert_to_fake(linear, sim.rtn_weight(w, cfg.w_bits, cfg.group_size), cfg.a_bits == 8, label)
        return
    g = cfg.group_size
    hessian = cap.hessians[name].hessian() if name in cap.hessians else None
    if name in cap.cross:
        w = asymmetric_target(w, hessian, cap.cross[name].hessian(), cfg.asymmetric_alpha)
    clip = None
    if cfg.clip:
        clip = search_clip_ratios(w, cap.samples[name], lambda rows, r: sim.qoq_rtn(rows, g, r))
        info[f"{name}.clip_mean"] = round(float(clip.mean()), 4)
    group_params = None
    if cfg.group_search and g:
        hdiag = None if hessian is None else torch.diag(hessian)
        def group_params(x, col):
            return search_group_params(x, None if hdiag is None else hdiag[col:col + g])
    quantizer = WeightQuantizer(w, g, clip, group_params)
    if cfg.gptq:
        # Dynamic groups (params from the error-compensated columns). act_order with
        # static groups won on a 4k-token excerpt but lost on the full license
        # texts (g64 W4A8KV4: 31.4 vs 28.9 PPL), so it stays off.
        q, _ = gptq_quantize(w, hessian, quantizer)
    elif group_params is not None:
        q = quantizer.quantize_all(w)
    else:
        q = (qoq_ref.quantize_weight_group(w, g, clip) if g
             else qoq_ref.quantize_weight_channel(w, clip))
    if cfg.a_bits == 8:
        sim.convert_to_qoq(linear, q, g)
    else:  # W4A16 in QoQ's weight format: dequantize, keep activations exact
        deq = qoq_ref.group_weight_to_float(q) if g else qoq_ref.channel_weight_to_float(q)
        sim.convert_to_fake(linear, deq, False, "fake-w4a16")


def _weight_quant_fn(cfg: QuantConfig):
    """Dequantized RTN weights in the configured format, for the alpha search."""
    g = cfg.group_size
    if cfg.w_bits == 16:
        return lambda w: w
    if cfg.is_qoq_format or (cfg.w_bits == 4 and cfg.progressive):
        return lambda w: sim.qoq_rtn(w, g)
    return lambda w: sim.rtn_weight(w, cfg.w_bits, g)


def _transform_layer(layer, cap: LayerCapture, cfg: QuantConfig, arch, info: dict) -> None:
    h, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    rotary = arch.rotary_dim  # partial rotary embeddings: SmoothAttention pairs only the channels RoPE turns
    lam = None
    # The key shift leaves a softmax unchanged (it moves every score of a
    # query by q . shift), but not soft-capped scores (Gemma 2: tanh(s - c) is
    # not tanh(s) - c): their keys are rotated only.
    centered = cfg.uses_key_transform and not arch.attn_softcap
    key_mean = cap.key_mean if centered else torch.zeros_like(cap.key_mean)
    if cfg.smooth_attention and cfg.kv_bits == 4:
        # with a key shift the codes see centered keys: smooth what is left of them
        k_abs = cap.centered_key_absmax() if centered else cap.key_absmax
        alpha = cfg.smooth_attention_alpha
        if alpha is None:
            kt = (key_mean, key_rotation(d, cfg.seed)) if cfg.uses_key_transform else (None, None)
            alpha = search_key_alpha(cap.q_sample, cap.k_sample, cap.v_sample, cfg.smooth_attention_grid,
                                     k_abs, *kt, rotary=rotary, scale=arch.attn_scale,
                                     softcap=arch.attn_softcap or 0.0)
        info["alpha_attn"] = alpha
        if alpha:
            lam = smooth_attention(layer, k_abs, alpha, h, hkv, d, rotary)
    if cfg.uses_key_transform:
        center_and_rotate_keys(layer, key_mean, lam, cfg.seed)
    o_abs, down_abs = cap.absmax["self_attn.o_proj"], cap.absmax["mlp.down_proj"]
    if cfg.reorder and cfg.group_size:
        perm = reorder_down(layer, down_abs)
        down_abs = down_abs[perm]
        cap.permute_inputs("mlp.down_proj", perm)
        perm = reorder_out_proj(layer, o_abs, h, hkv, d)
        o_abs = o_abs[perm]
        cap.permute_inputs("self_attn.o_proj", perm)
    wq, act8 = _weight_quant_fn(cfg), cfg.a_bits == 8

    def strength(name: str, w, scales_for) -> float:
        """cfg.smooth_alpha, else the one search_alpha finds for linear `name`'s inputs."""
        if cfg.smooth_alpha is not None:
            return cfg.smooth_alpha
        return search_alpha(cap.samples[name], w, cfg.smooth_alpha_grid, wq, act8, scales_for)

    if cfg.smooth_in:
        for key, name, norm, linear in (
                ("qkv", "self_attn.qkv_proj", layer.input_layernorm, layer.self_attn.qkv_proj),
                ("gate", "mlp.gate_up_proj", layer.mlp_input_norm, layer.mlp.gate_up_proj)):
            w, act = linear.weight.detach(), cap.absmax[name]
            alpha = strength(name, w, lambda a, w=w, act=act: smooth_scales(act, w.abs().amax(dim=0), a))
            cap.scale_inputs(name, 1 / smooth_input(norm, linear, act, alpha))
            info[f"alpha_{key}"] = alpha
    if not cfg.smooth_out:
        return
    w_down = layer.mlp.down_proj.weight.detach()
    alpha = strength("mlp.down_proj", w_down, lambda a: smooth_scales(down_abs, w_down.abs().amax(dim=0), a))
    cap.scale_inputs("mlp.down_proj", 1 / smooth_down(layer, down_abs, alpha))
    info["alpha_down"] = alpha
    w_o = layer.self_attn.o_proj.weight.detach()
    # the scales smooth_out_proj would use: shared by the query heads of a KV group
    o_act, o_w = group_max(o_abs.double(), h, hkv, d), group_max(w_o.abs().amax(dim=0).double(), h, hkv, d)
    alpha = strength("self_attn.o_proj", w_o, lambda a: expand_groups(smooth_scales(o_act, o_w, a), h, hkv))
    s_o = smooth_out_proj(layer, o_abs, alpha, h, hkv, d)
    cap.scale_inputs("self_attn.o_proj", 1 / expand_groups(s_o, h, hkv))
    info["alpha_o"] = alpha


def _needs_statistics(cfg: QuantConfig) -> bool:
    """Round-to-nearest without transforms needs no calibration pass at all."""
    uses_kv = (cfg.smooth_attention and cfg.kv_bits == 4) or cfg.uses_key_transform
    uses_w = cfg.w_bits != 16 and (cfg.gptq or cfg.clip)
    return uses_kv or uses_w or cfg.smooth_out or cfg.smooth_in or (cfg.reorder and cfg.group_size > 0)


def _layer_steps(cfg: QuantConfig) -> list[str]:
    """The per-layer steps that ran: switched on and meaningful for this format."""
    applies = {"smooth_attention": cfg.kv_bits == 4, "key_transform": cfg.kv_bits == 4,
               "reorder": cfg.group_size > 0, "smooth_in": True, "smooth_out": True, "clip": True, "gptq": True,
               "true_sequential": True, "asymmetric_calibration": cfg.gptq and cfg.w_bits != 16,
               "group_search": cfg.group_size > 0 and cfg.w_bits == 4}
    return [step for step, ok in applies.items() if ok and getattr(cfg, step)]


def _round_to_storage(model, qoq: QoQConfig) -> None:
    """Round the unquantized tensors to the dtype the checkpoint stores them in
    (QoQConfig.float_storage_dtype), so the in-memory simulation is exactly the
    model a checkpoint load gives back."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype == torch.float32:
            p.data.copy_(p.data.to(qoq.float_storage_dtype(name)).float())


def quantize_model(source, cfg: QuantConfig, calib: CalibrationSet, device: str = "cpu",
                   progress: bool = True, max_positions: int = 4096,
                   float_weights: dict | None = None, rotation: torch.Tensor | None = None) -> QuantResult:
    """float_weights: when a dict, it receives each linear's weight as it is just
    before quantization (rotated, smoothed, reordered), by "layers.{i}.{linear}".
    rotation: the residual rotation to fold (e.g. one learned by an earlier run
    of the same config), instead of cfg.rotation's."""
    cfg.check_model(source.arch)
    if cfg.rotate and source.arch.sandwich_norms:
        # Gemma normalizes each sublayer's output before the residual add: an
        # elementwise weight, which a rotation of the residual stream does not
        # commute with; its linears are quantized in the unrotated basis
        log.warning("%s: no residual rotation for a %s model (its sublayers' output norms do not commute "
                    "with one): its block inputs are smoothed into the norms instead", cfg.name,
                    source.arch.architecture)
        cfg = dataclasses.replace(cfg, rotate=False, smooth_in=True)
    top = max((max(sample) for sample in calib.samples if sample), default=-1)
    if top >= source.arch.vocab_size:  # an embedding lookup would fail deep inside the first pass
        raise ValueError(f"calibration token id {top} is past the model's vocabulary ({source.arch.vocab_size} "
                         "tokens): the tokenizer does not belong to this model")
    start = time.perf_counter()
    if torch.device(device).type == "cpu":
        prebuild.build_all()
    torch.manual_seed(cfg.seed)
    model = build_fp_model(source, cfg, device, max_positions)
    arch = model.cfg
    steps, tuning = [], None
    with torch.no_grad():
        curve = []
        if cfg.rotate:
            q = rotation
            if q is None and cfg.rotation == "learned":
                fold_norms(model)  # R is learned on the folded model rotate_model rotates
                learned = learn_rotation(model, calib.samples, cfg, progress=progress)
                q, curve = learned.r, learned.curve
            rotate_model(model, seed=cfg.seed, q=q)
            steps.append("rotate-learned" if cfg.rotation == "learned" else "rotate")
        if cfg.rotate_v and cfg.kv_bits == 4:
            rotate_values(model, seed=cfg.seed)
            steps.append("rotate_v")
        lengths = tuple(map(len, calib.samples))
        ids = torch.tensor([t for sample in calib.samples for t in sample], device=device)
        hidden = torch.nn.functional.embedding(ids, model.embed_tokens)
        hidden_fp = hidden if cfg.asymmetric_calibration else None
        layers = tqdm(model.layers, desc=f"quantize {cfg.name}", unit="layer", disable=not progress)
        infos = []
        for index, layer in enumerate(layers):
            info: dict = {}
            hessians = cfg.gptq and cfg.w_bits != 16
            sequential = cfg.true_sequential and _needs_statistics(cfg)
            # one measuring pass: the transforms below only permute and rescale the
            # o_proj / down_proj inputs, so their Hessians and samples follow exactly.
            # True-sequential: only the first linear's Hessian comes from it, the
            # others' from the quantized linears before them (layer_passes.sequential_layer).
            # Its output is not used (the layer runs again once quantized), so
            # down_proj's product is skipped. Asymmetric calibration: an FP pass
            # first (the targets), and the Hessians from a pass after the transforms
            targets = None
            if hidden_fp is not None and hessians:
                hidden_fp, targets = layer_passes.fp_layer_inputs(layer, hidden_fp, lengths)
            cap = LayerCapture(layer, LINEARS, arch, hessians=hessians and not sequential and targets is None,
                               skip_outputs=LINEARS[-1:], targets=targets)
            first = LayerCapture(layer, LINEARS[:1], arch, hessians=hessians) if sequential else cap
            if _needs_statistics(cfg):
                with cap, first if sequential else contextlib.nullcontext():
                    layer_passes.run_layer(layer, hidden, lengths)
                _transform_layer(layer, cap, cfg, arch, info)
            if targets is not None:
                layer_passes.transformed_statistics(layer, hidden, lengths, arch, cap)

            def quantize(name, linear_cap, index=index, layer=layer, info=info):
                layers.set_postfix_str(name.split(".")[-1])
                key = f"layers.{index}.{name}"
                if float_weights is not None:
                    float_weights[key] = layer.get_submodule(name).weight.detach().clone()
                _quantize_linear(layer.get_submodule(name), linear_cap, cfg, info, name, key)

            if sequential:
                hidden = layer_passes.sequential_layer(layer, hidden, lengths, arch, hessians, first, quantize)
            else:
                for name in LINEARS:
                    quantize(name, cap)
                hidden = layer_passes.run_layer(layer, hidden, lengths)
            infos.append(info)
        # the passes above ran the quantized linears on INT8 GEMMs (same numbers)
        sim.use_reference_simulation(model)
        qoq = QoQConfig(cfg.group_size, cfg.kv_bits, cfg.uses_key_transform) if cfg.is_qoq_format else None
        if qoq is not None:
            _round_to_storage(model, qoq)
    steps += _layer_steps(cfg)
    if cfg.scale_tuning_epochs:  # on the model as stored, then the tuned norm weights rounded too
        fp_cfg = dataclasses.replace(cfg, w_bits=16, a_bits=16, kv_bits=16, scale_tuning_epochs=0)
        teacher = build_fp_model(source, fp_cfg, device, max_positions)
        tuning = tune_scales(model, teacher, spread_windows(calib.samples, cfg.scale_tuning_windows),
                             cfg.scale_tuning_epochs, cfg.scale_tuning_lr, cfg.scale_tuning_norms, cfg.seed, progress)
        del teacher
        steps.append("scale-tuning")
        with torch.no_grad():
            _round_to_storage(model, qoq)
    return QuantResult(model, cfg, steps, infos, time.perf_counter() - start, curve, tuning)
