"""What to quantize and how: one dataclass, plus the named presets."""
from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, replace

# the linears of one decoder layer, in the order the pipeline quantizes them
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ROTATIONS = ("hadamard", "learned")
ROTATION_LOSSES = ("kl", "ce")


@dataclass(frozen=True)
class QuantConfig:
    name: str = "g64"
    w_bits: int = 4               # 4, 8, or 16 (weights left alone)
    group_size: int = 64          # 0 = per output channel
    progressive: bool = True      # QoQ two-level INT8 -> UINT4 (else plain asymmetric groups)
    a_bits: int = 8               # 8 = per-token INT8 activations, 16 = unquantized
    kv_bits: int = 4              # 4 = per-token-per-head UINT4 KV, 16 = unquantized
    rotate: bool = True           # block-input rotation of the residual stream
    # which rotation: "hadamard" (fixed, seeded) or "learned" (trained from the
    # Hadamard start against the fake-quantized model, quant/transforms/learned_rotation.py;
    # docs/accuracy.md). The rotation_* fields below only matter for "learned".
    rotation: str = "hadamard"
    rotation_steps: int = 100
    rotation_lr: float = 1e-3             # Adam on the Cayley generator
    rotation_lr_decay: bool = False       # linearly to 0 over the steps (else constant)
    rotation_samples: int = 16            # calibration windows trained on ...
    rotation_seq_len: int = 256           # ... their first tokens
    rotation_batch: int = 2               # windows per step
    rotation_loss: str = "kl"             # "kl" to the FP model's logits, or "ce" (next token)
    rotation_act_quant: bool = True       # per-token INT8 linear inputs in the loop
    rotation_kv_quant: bool = False       # KV4 in the loop (keys not yet centered there)
    # per-head rotation of V folded into v_proj/o_proj; off by default: it did not
    # lower the KV4 loss on SmolLM2 (docs/accuracy.md)
    rotate_v: bool = False
    # SmoothAttention: off by default: after the key transform it made SmolLM2
    # worse (docs/accuracy.md). When on, alpha None = searched over
    # smooth_attention_grid (0 = none).
    smooth_attention: bool = False
    smooth_attention_alpha: float | None = None
    smooth_attention_grid: tuple[float, ...] = (0.0, 0.125, 0.25, 0.375, 0.5)
    # post-RoPE key centering + per-head rotation (layers/key_transform.py), KV4 only
    key_transform: bool = True
    smooth_out: bool = True       # block-output smoothing (o_proj, down_proj inputs)
    # block-input smoothing (qkv_proj, gate_up_proj inputs, into the norms before
    # them): where the residual stream is not rotated (Gemma turns it on: the
    # quantizer skips the rotation there)
    smooth_in: bool = False
    smooth_alpha: float | None = None  # None: searched per layer over smooth_alpha_grid
    smooth_alpha_grid: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35)
    reorder: bool = True          # activation-aware input-channel reordering (group configs)
    clip: bool = False            # weight clipping ratio search
    gptq: bool = True             # error-compensating rounding
    group_search: bool = True     # level-2 (s2, z) by weighted error search, not by range
    # inside a layer, each linear's GPTQ Hessian (and clip samples) from the
    # inputs that the already-quantized linears before it produce; off: it did
    # not help on SmolLM2 (docs/accuracy.md)
    true_sequential: bool = False
    # asymmetric calibration (GPTAQ-style): GPTQ matches each linear's output on
    # the quantized model's inputs to the FP model's output on its own inputs
    # (an extra FP pass per layer); off: standard GPTQ, the FP layer's output
    # on the quantized model's inputs
    asymmetric_calibration: bool = False
    # the share of the least-squares correction toward the FP outputs it applies
    # (gptq.asymmetric_target)
    asymmetric_alpha: float = 0.25
    # the mixed recipe: linears kept at W8A8 (per-channel INT8 weights, per-token
    # INT8 activations), fnmatch patterns over "layers.{i}.{linear}", e.g.
    # "layers.0.*", "*.mlp.down_proj" (bytes and accuracy: docs/accuracy.md)
    w8a8_linears: tuple[str, ...] = ()
    # 128 x 512 asks for more than the shipped text holds: all of it is used
    # (fewer windows cost accuracy: docs/accuracy.md)
    calib_samples: int = 128
    calib_seq_len: int = 512
    # windows of calib_long_seq_len tokens besides the short ones (quant/calibration.py):
    # 512-token windows never show the quantizer a position past 512
    calib_long_samples: int = 0
    calib_long_seq_len: int = 2048
    # end-to-end tuning of the float scales (each QoQ linear's s1 and, with
    # scale_tuning_norms, the RMSNorm weights) by KL to the FP model over the
    # calibration windows, after every layer is quantized (quant/scale_tuning.py);
    # epochs over the windows, 0 = off
    scale_tuning_epochs: int = 0
    scale_tuning_lr: float = 2e-3
    scale_tuning_norms: bool = True
    # how many calibration windows it trains on, spread evenly over the text
    # (0 = all): a short tuning keeps most of the gain for a fraction of the time
    scale_tuning_windows: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.w_bits not in (4, 8, 16):
            raise ValueError(f"w_bits must be 4, 8 or 16, got {self.w_bits}")
        if self.a_bits not in (8, 16) or self.kv_bits not in (4, 16):
            raise ValueError("a_bits must be 8 or 16 and kv_bits 4 or 16")
        if self.group_size not in (0, 32, 64, 128, 256):
            raise ValueError("group_size must be 0 (per channel), 32, 64, 128 or 256")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        if self.rotation_loss not in ROTATION_LOSSES:
            raise ValueError(f"rotation_loss must be one of {', '.join(ROTATION_LOSSES)}, "
                             f"got {self.rotation_loss!r}")
        if self.asymmetric_calibration and self.true_sequential:
            raise ValueError("asymmetric_calibration and true_sequential cannot be combined")
        if self.scale_tuning_epochs < 0 or self.scale_tuning_windows < 0 or self.scale_tuning_lr <= 0:
            raise ValueError("scale_tuning_epochs and scale_tuning_windows must be >= 0 and scale_tuning_lr > 0")
        if self.scale_tuning_epochs and not self.is_qoq_format:
            raise ValueError("scale tuning needs a QoQ W4A8 format (w_bits 4, a_bits 8, progressive groups "
                             "or per channel); turn it off for others (scale_tuning_epochs=0, "
                             "--scale-tuning-epochs 0)")
        if min(self.rotation_steps, self.rotation_samples, self.rotation_seq_len, self.rotation_batch) < 1:
            raise ValueError("rotation_steps, rotation_samples, rotation_seq_len and rotation_batch "
                             "must be >= 1")

    @property
    def is_qoq_format(self) -> bool:
        """True when the result is a W4A8 checkpoint the runtime kernels execute."""
        return self.w_bits == 4 and self.a_bits == 8 and (self.progressive or self.group_size == 0)

    def keeps_w8a8(self, key: str) -> bool:
        """Is linear "layers.{i}.{linear}" one of the w8a8_linears?"""
        return any(fnmatch.fnmatchcase(key, p) for p in self.w8a8_linears)

    def w8a8_names(self, num_layers: int) -> tuple[str, ...]:
        """The w8a8_linears patterns expanded over a model of num_layers layers."""
        return tuple(key for i in range(num_layers) for name in LINEARS
                     if self.keeps_w8a8(key := f"layers.{i}.{name}"))

    def check_model(self, arch) -> None:
        """Raise, before any work, if this config cannot quantize a model of these
        dimensions: groups must tile every linear's input (qkv and gate_up take
        the hidden size, o_proj heads x head_dim, down_proj the intermediate size)."""
        if self.smooth_attention and self.kv_bits == 4 and arch.qk_norm:
            raise ValueError(f"{self.name}: SmoothAttention scales the q and k rows of qkv_proj, which this "
                             "model's per-head q/k norms (Qwen3, Gemma 3) normalize away; quantize it without "
                             "smooth_attention (the key transform handles its keys)")
        if self.w_bits != 4 or not self.group_size:
            return
        widths = {"hidden size": arch.hidden_size, "heads x head_dim": arch.num_heads * arch.head_dim,
                  "intermediate size": arch.intermediate_size}
        bad = [f"{what} {n}" for what, n in widths.items() if n % self.group_size]
        if bad:
            fits = [g for g in (32, 64, 128, 256) if all(n % g == 0 for n in widths.values())]
            raise ValueError(f"{self.name}: group size {self.group_size} does not divide the model's "
                             f"{', '.join(bad)}; group sizes that fit: "
                             f"{', '.join(map(str, fits)) or 'none'} (or 0, per channel)")

    @property
    def longest_calibration_window(self) -> int:
        return max(self.calib_seq_len, self.calib_long_seq_len if self.calib_long_samples else 0)

    @property
    def uses_key_transform(self) -> bool:
        return self.key_transform and self.kv_bits == 4

    def to_dict(self) -> dict:
        d = asdict(self)
        d["smooth_alpha_grid"] = list(self.smooth_alpha_grid)
        d["smooth_attention_grid"] = list(self.smooth_attention_grid)
        d["w8a8_linears"] = list(self.w8a8_linears)
        return d


_QOQ = QuantConfig()
NO_TRANSFORMS = dict(rotate=False, rotate_v=False, smooth_attention=False, key_transform=False,
                     smooth_out=False, smooth_in=False, reorder=False,
                     clip=False, gptq=False, group_search=False, scale_tuning_epochs=0,
                     scale_tuning_windows=0)

# the QServe recipes end with a short end-to-end scale tuning (one pass over 20
# windows): most of what the long one gains in perplexity and long-context
# retrieval for a fraction of its time (docs/accuracy.md, "Short tuning by default")
_SHORT_TUNING = dict(scale_tuning_epochs=1, scale_tuning_windows=20)

PRESETS: dict[str, QuantConfig] = {
    # the QServe configurations
    "g128": replace(_QOQ, name="g128", group_size=128, **_SHORT_TUNING),
    "g64": replace(_QOQ, name="g64", group_size=64, **_SHORT_TUNING),
    "chn": replace(_QOQ, name="chn", group_size=0, reorder=False, clip=True, **_SHORT_TUNING),
    # g64 with the long tuning (two passes over every window): lower
    # perplexity still, for minutes more of quantization (docs/accuracy.md)
    "g64-tuned": replace(_QOQ, name="g64-tuned", group_size=64, scale_tuning_epochs=2),
    # round-to-nearest baselines for the accuracy table
    "rtn-w8a8": QuantConfig(name="rtn-w8a8", w_bits=8, group_size=0, progressive=False,
                            kv_bits=16, **NO_TRANSFORMS),
    "rtn-w4a16-g64": QuantConfig(name="rtn-w4a16-g64", group_size=64, progressive=False,
                                 a_bits=16, kv_bits=16, **NO_TRANSFORMS),
    "rtn-w4a8kv4-g64": QuantConfig(name="rtn-w4a8kv4-g64", group_size=64, **NO_TRANSFORMS),
    "rtn-w4a8kv4-chn": QuantConfig(name="rtn-w4a8kv4-chn", group_size=0, **NO_TRANSFORMS),
    "rtn-kv4": QuantConfig(name="rtn-kv4", w_bits=16, a_bits=16, **NO_TRANSFORMS),
}


def with_rotation(configs, rotation: str | None) -> list[QuantConfig]:
    """The configs that rotate, switched to `rotation` (None: as they are);
    renamed so that a table tells them apart."""
    if rotation is None:
        return list(configs)
    return [replace(c, rotation=rotation, name=f"{c.name} ({rotation} rotation)")
            if c.rotate and c.rotation != rotation else c for c in configs]


def with_seeds(configs, seeds) -> list[QuantConfig]:
    """Each config once per seed (the seeded Hadamard rotations), named so that
    a table tells them apart; seeds empty: the configs as they are. One seed's
    result can sit far from another's (docs/accuracy.md), so a recipe is
    compared over several."""
    if not seeds:
        return list(configs)
    return [replace(c, seed=s, name=f"{c.name} seed {s}") for c in configs for s in seeds]


def get_preset(name: str, **overrides) -> QuantConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown quantization config {name!r}; choose from {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
