"""Architecture description of a Llama-family decoder, independent of file format.

Every loader (HF directory, GGUF file, synthetic shapes) produces one of these;
the model and the engine read nothing else about the checkpoint.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

_HF_NAMES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
             "qwen3": ("Qwen3ForCausalLM", "qwen3"), "phi3": ("Phi3ForCausalLM", "phi3"),
             "smollm3": ("SmolLM3ForCausalLM", "smollm3"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
             "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    # Granite's four scalar multipliers are folded into its weights at load
    # (model_loader/scalar_folds.py): what remains is a Llama
    "GraniteForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")


class UnsupportedModelError(ValueError):
    pass


def _nope_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: its `no_rope_layers` flags (1: RoPE),
    else every `no_rope_layer_interval`-th layer, as transformers derives them."""
    n = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if len(flags) != n:
        raise UnsupportedModelError(f"no_rope_layers has {len(flags)} flags for {n} layers")
    return tuple(i for i, f in enumerate(flags) if not f)


def yarn_scaling(scaling: dict[str, Any], max_positions: int) -> tuple[dict[str, Any], int]:
    """YaRN's parameters made explicit (the pretrained context, and the factor,
    which transformers derives from the two lengths when absent) and the
    context it reaches: the pretrained one times the factor, as vLLM derives it."""
    orig = int(scaling.get("original_max_position_embeddings") or max_positions)
    factor = float(scaling.get("factor") or max_positions / orig)
    out = {k: v for k, v in scaling.items() if k != "type"}
    out.update(rope_type="yarn", factor=factor, original_max_position_embeddings=orig)
    return out, max(max_positions, int(orig * factor))


def longrope_scaling(scaling: dict[str, Any], max_positions: int, orig: int | None, freqs: int) -> dict[str, Any]:
    """LongRoPE's parameters made explicit (Phi-3 128k, Phi-3.5; "su" is its
    first name): the pretrained context (Phi-3's configs keep it beside
    rope_scaling), the factor (the two contexts' ratio where absent, as
    transformers derives it) and the factor cos and sin are scaled by.
    freqs: the rotary frequencies, one long and one short factor each."""
    orig = int(scaling.get("original_max_position_embeddings") or orig or 0)
    if not orig or not scaling.get("long_factor") or not scaling.get("short_factor"):
        raise UnsupportedModelError("longrope rope_scaling needs long_factor, short_factor and "
                                    "original_max_position_embeddings")
    if not len(scaling["long_factor"]) == len(scaling["short_factor"]) == freqs:
        raise UnsupportedModelError(f"longrope needs a long and a short factor for each of {freqs} frequencies; "
                                    f"got {len(scaling['long_factor'])} and {len(scaling['short_factor'])}")
    factor = float(scaling.get("factor") or max_positions / orig)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {"rope_type": "longrope", "long_factor": [float(f) for f in scaling["long_factor"]],
            "short_factor": [float(f) for f in scaling["short_factor"]], "factor": factor,
            "original_max_position_embeddings": orig, "attention_factor": float(attention)}


# transformers' Gemma3TextConfig defaults, which the text_config of the
# multimodal checkpoints (Gemma 3 4B/12B/27B) leaves out
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                         "head_dim": 256, "max_position_embeddings": 131072, "sliding_window": 4096,
                         "bos_token_id": 2, "eos_token_id": 1}


# multimodal checkpoints whose text model is served (their vision parts are
# not read: model_loader/hf_dir.py), and the text model's class by its model_type
MULTIMODAL_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                            "LlavaForConditionalGeneration")
_TEXT_CLASSES = {"gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}


def is_multimodal(cfg: dict[str, Any]) -> bool:
    return any(a in MULTIMODAL_ARCHITECTURES for a in cfg.get("architectures") or [])


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config (Gemma 3 4B+, Mistral Small 3.1,
    Llava/Pixtral) as its text model's: the text_config (Gemma's with the
    defaults transformers fills in), the top level's token ids and tying;
    any other config as it is."""
    if not is_multimodal(cfg):
        return cfg
    text = dict(cfg.get("text_config") or {})
    archs = cfg.get("architectures") or []
    kind = text.get("model_type") or ("gemma3_text" if "Gemma3ForConditionalGeneration" in archs
                                      else "mistral" if "Mistral3ForConditionalGeneration" in archs else "llama")
    if kind not in _TEXT_CLASSES:
        raise UnsupportedModelError(f"unsupported text model {kind!r} in a {archs[0]} checkpoint")
    if kind == "gemma3_text":
        text = {**_GEMMA3_TEXT_DEFAULTS, **text}
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):  # transformers ties by the top level's
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return {**text, "architectures": [_TEXT_CLASSES[kind]], "model_type": kind}


def sliding_pattern(layers: int, every: int) -> tuple[int, ...]:
    """The sliding layers of a model with one global layer every `every`
    (Gemma 3: 6), the last of each group, as transformers and llama.cpp count."""
    return tuple(i for i in range(layers) if (i + 1) % every)


def _gemma_config(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """A Gemma 2 or Gemma 3 text config in the keys the rest of
    from_hf_config reads, as transformers fills it in. Gemma 2: every other
    layer sliding (the first of each pair), scores and logits soft-capped at
    50 and 30 unless the config says otherwise. Gemma 3: the global layers'
    RoPE (theta 1M, the config's scaling) apart from the sliding layers'
    (rope_local_base_freq, 10k; or transformers 5's rope_parameters per
    layer type), five sliding layers to a full one unless layer_types says.
    Both: GELU-tanh, tied embeddings."""
    out = dict(cfg)
    if arch == "Gemma2ForCausalLM":
        every = 2
        out.setdefault("rope_theta", 1e4)
        out.setdefault("sliding_window", 4096)
        out.setdefault("attn_logit_softcapping", 50.0)
        out.setdefault("final_logit_softcapping", 30.0)
    else:
        every = out.get("sliding_window_pattern", 6)
        params = out.pop("rope_parameters", None)
        if isinstance(params, dict) and "full_attention" in params:
            full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"RoPE scaling {local['rope_type']!r} on the sliding layers is "
                                            "not supported")
            out["rope_theta"], out["rope_local_base_freq"] = full.get("rope_theta", 1e6), local.get("rope_theta", 1e4)
            out["rope_scaling"] = ({k: v for k, v in full.items() if k != "rope_theta"}
                                   if full.get("rope_type", "default") != "default" else None)
        elif params is not None:
            out["rope_parameters"] = params
        out.setdefault("rope_theta", 1e6)
        out.setdefault("rope_local_base_freq", 1e4)
    if not out.get("layer_types"):
        sliding = sliding_pattern(out["num_hidden_layers"], every)
        out["layer_types"] = ["sliding_attention" if i in sliding else "full_attention"
                              for i in range(out["num_hidden_layers"])]
    out["hidden_act"] = out.get("hidden_activation") or out.get("hidden_act") or "gelu_pytorch_tanh"
    out.setdefault("tie_word_embeddings", True)
    out.setdefault("head_dim", 256)
    out.setdefault("rms_norm_eps", 1e-6)
    out.setdefault("query_pre_attn_scalar", 256)
    return out


def _sliding_window(cfg: dict[str, Any], arch: str) -> tuple[int | None, tuple[int, ...] | None]:
    """The window of an HF config whose attention really slides, and the
    layers that slide (None: all), as transformers reads them: Qwen2/Qwen3
    configs carry a `sliding_window` that only `use_sliding_window` turns on,
    for the layers from `max_window_layers` on; `layer_types` says per layer."""
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if not window:
        return None, None
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if qwen and not cfg.get("use_sliding_window", False):
        return None, None
    types = cfg.get("layer_types")
    if types is None and qwen:
        first = cfg.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if types is None:
        return int(window), None
    if len(types) != n:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {n} layers")
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not layers:
        return None, None
    return int(window), None if len(layers) == n else layers


@dataclass
class ModelArchConfig:
    architecture: str  # key of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int | None = None  # the channels RoPE turns, the first of each head; None: all (head_dim)
    mlp_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    attn_scale: float | None = None  # the attention scores' scale; None: head_dim ** -0.5
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled); None: rope_theta
    embed_scale: float | None = None  # Gemma: the embeddings times sqrt(hidden), in the model's dtype
    attn_softcap: float | None = None  # Gemma 2: scores s -> cap * tanh(s / cap) before the softmax; None: none
    logit_softcap: float | None = None  # Gemma 2: the final logits, likewise
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None = plain RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has bias on q/k/v
    # positions a query sees (itself and the window - 1 before it) where the
    # model was trained with sliding-window attention (Mistral 7B v0.1, Qwen2
    # with use_sliding_window); None: all before it
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None  # the layers that slide; None: every layer
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers whose attention has no RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention, or None (it sees all before it)."""
        if self.sliding_window is None or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    @property
    def window_of_every_layer(self) -> int | None:
        """The sliding window where every layer's attention slides, else None."""
        return self.sliding_window if self.sliding_layers is None else None

    @property
    def qk_norm(self) -> bool:
        """Qwen3, Gemma 3: an RMSNorm over each q and k head (weights [head_dim]) before RoPE."""
        return self.architecture in ("qwen3", "gemma3")

    @property
    def sandwich_norms(self) -> bool:
        """Gemma 2 and 3: RMSNorms on the attention's and the MLP's outputs too, before
        each residual add (post_attention_layernorm, post_feedforward_layernorm),
        and the MLP's input norm is pre_feedforward_layernorm."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def norm_offset(self) -> bool:
        """Gemma: its checkpoints store each RMSNorm weight as w - 1 (the norm
        multiplies by 1 + w); the loader adds the 1 (model_loader/scalar_folds.py)."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def fused_checkpoint_linears(self) -> bool:
        """Phi-3: its checkpoints hold q/k/v as one qkv_proj and gate/up as one
        gate_up_proj, as the model does, not one tensor per part."""
        return self.architecture == "phi3"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArchConfig":
        cfg = text_model_config(cfg)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        gemma = SUPPORTED_ARCHITECTURES[arch] in GEMMA_ARCHITECTURES
        if gemma:
            cfg = _gemma_config(cfg, arch)
        act = cfg.get("hidden_act", "silu")
        acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
        if act not in acts:  # the MLP is gated: SwiGLU or GeGLU (tanh); another would run wrong
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}: the MLP here is SwiGLU (silu) or "
                                        "GeGLU (gelu_pytorch_tanh)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 moves rope settings into "rope_parameters"
        params = cfg.get("rope_parameters")
        partial = cfg.get("partial_rotary_factor") or (params or {}).get("partial_rotary_factor") or 1.0
        rotary_dim = int(head_dim * partial)  # as transformers rounds it (Phi-4-mini: 0.75 of 128)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise UnsupportedModelError(f"partial_rotary_factor {partial} of head_dim {head_dim}: "
                                        f"{rotary_dim} rotary channels, not an even count of them")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        max_positions = cfg.get("max_position_embeddings", 4096)
        if rope_scaling is not None:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype == "default":
                rope_scaling = None
            elif rtype == "yarn":
                rope_scaling, max_positions = yarn_scaling(rope_scaling, max_positions)
            elif rtype in ("longrope", "su"):
                rope_scaling = longrope_scaling(rope_scaling, max_positions,
                                                cfg.get("original_max_position_embeddings"), rotary_dim // 2)
            elif rtype not in ("llama3", "linear"):
                raise UnsupportedModelError(f"unsupported rope_scaling type {rtype!r}")
        window, window_layers = _sliding_window(cfg, arch)
        return cls(
            architecture=SUPPORTED_ARCHITECTURES[arch],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            mlp_act=acts[act],
            attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            rope_local_theta=float(cfg["rope_local_base_freq"]) if cfg.get("rope_local_base_freq") else None,
            embed_scale=float(cfg["hidden_size"]) ** 0.5 if gemma else None,
            attn_softcap=softcap_of(cfg.get("attn_logit_softcapping")) if gemma else None,
            logit_softcap=softcap_of(cfg.get("final_logit_softcapping")) if gemma else None,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama-style configs say so explicitly
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
            sliding_window=window,
            sliding_layers=window_layers,
            nope_layers=_nope_layers(cfg) if arch == "SmolLM3ForCausalLM" else (),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_config(self, torch_dtype: str) -> dict[str, Any]:
        """config.json for an HF directory holding this architecture (what from_hf_config reads)."""
        cls, model_type = _HF_NAMES[self.architecture]
        if self.architecture == "llama" and self.sliding_window is not None:
            cls, model_type = "MistralForCausalLM", "mistral"  # transformers' Llama does not slide
        layer_types = None  # Qwen's configs read them from max_window_layers otherwise; Mistral's slide everywhere
        if self.sliding_window is not None and (self.architecture != "llama" or self.sliding_layers is not None):
            layer_types = ["sliding_attention" if self.window_of(i) else "full_attention"
                           for i in range(self.num_layers)]
        return {
            "architectures": [cls], "model_type": model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "sliding_window": self.sliding_window, "use_sliding_window": self.sliding_window is not None,
            **({"layer_types": layer_types} if layer_types is not None else {}),
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_ids,
            "pad_token_id": None,  # unused here; Phi3Config's default id (32000) may pass a small vocabulary
            **({"partial_rotary_factor": self.rotary_dim / self.head_dim} if self.rotary_dim else {}),
            "torch_dtype": torch_dtype,
            **({"no_rope_layers": [int(i not in self.nope_layers) for i in range(self.num_layers)]}
               if self.architecture == "smollm3" else {}),
            **({"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": round(self.attn_scale ** -2),
                "final_logit_softcapping": self.logit_softcap, "attn_logit_softcapping": self.attn_softcap}
               if self.architecture in GEMMA_ARCHITECTURES else {}),
            **({"rope_local_base_freq": self.rope_local_theta} if self.architecture == "gemma3" else {}),
        }


def softcap_of(value: Any) -> float | None:
    """A soft cap from a config: None or 0 is none."""
    if value is None or float(value) == 0.0:
        return None
    if float(value) < 0 or not math.isfinite(float(value)):
        raise UnsupportedModelError(f"a logit soft cap must be positive, got {value!r}")
    return float(value)
