"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM2/3,
Gemma 2/3) over paged attention.

Tensors flow flattened: a batch is one [T, hidden] matrix of all its new
tokens, so linears see every request at once and attention alone knows where
one sequence ends (AttentionMetadata).
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import torch
from torch import nn

from qoqserve.layers.attention import AttentionMetadata, PagedAttention
from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.key_transform import KeyTransform
from qoqserve.layers.linear import (
    Linear,
    LinearMethod,
    LinearShard,
    UnquantizedLinearMethod,
    materialize,
)
from qoqserve.layers.logits import LogitsHead
from qoqserve.layers.norm import RMSNorm
from qoqserve.layers.page_map import PageMap
from qoqserve.layers.parallel import SINGLE, TensorParallel
from qoqserve.layers.rotary import RotaryEmbedding
from qoqserve.layers.token_ops import TorchTokenOps
from qoqserve.models.arch import ModelArchConfig

# a linear's method by its name inside its decoder layer ("self_attn.qkv_proj")
MethodFor = Callable[[str], LinearMethod]


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, method_for: MethodFor, attention: AttentionBackend | None,
                 rope: RotaryEmbedding, dtype: torch.dtype, key_transform: bool, ops: TorchTokenOps,
                 tp: TensorParallel, window: int | None = None):
        super().__init__()
        self.ops = ops
        d = self.head_dim = cfg.head_dim
        # this rank's query heads and the KV heads they read (layers/parallel.py)
        q0, self.num_heads = tp.split(cfg.num_heads, "attention heads")
        kv0, self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads, cfg.num_heads)
        q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        rows = ((q0 * d, self.num_heads * d), (kv0 * d, self.num_kv_heads * d),
                (kv0 * d, self.num_kv_heads * d))
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.attention_bias,
                               method_for("self_attn.qkv_proj"), dtype,
                               LinearShard(rows=rows) if tp.size > 1 else None)
        self.o_proj = Linear(q_size, cfg.hidden_size, False, method_for("self_attn.o_proj"), dtype,
                             _row_shard(tp, rows[0]))
        self.rope = rope
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, attention, window,
                                   cfg.attn_scale, cfg.attn_softcap)
        self.key_transform = (KeyTransform(self.num_kv_heads, self.head_dim, dtype,
                                           (kv0, self.num_kv_heads) if tp.size > 1 else None)
                              if key_transform else None)
        if cfg.qk_norm:  # one weight per channel, shared by every head: whole on every rank
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, ops)
        self.qk_norm = (self.q_norm, self.k_norm) if cfg.qk_norm else None

    def forward(self, positions, x, meta: AttentionMetadata, cache):
        q, k, v = self.ops.qkv_rope(self.qkv_proj(x), positions, self.rope, self.key_transform,
                                    self.num_heads, self.num_kv_heads, self.head_dim, self.qk_norm)
        return self.o_proj(self.attn(q, k, v, meta, cache))


def _row_shard(tp: TensorParallel, cols: tuple[int, int]) -> LinearShard | None:
    """A row-parallel linear over input slice `cols`: partial sums all-reduced,
    the bias added once."""
    if tp.size == 1:
        return None
    return LinearShard(cols=cols, reduce=tp.all_reduce, add_bias=tp.rank == 0)


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, method_for: MethodFor, dtype: torch.dtype, ops: TorchTokenOps,
                 tp: TensorParallel):
        super().__init__()
        self.ops = ops
        inter = cfg.intermediate_size
        cols = tp.split(inter, "MLP intermediate channels")
        self.gelu = cfg.mlp_act == "gelu_tanh"  # Gemma's GeGLU; else SwiGLU, fused where the kernels can
        self.gate_up_proj = Linear(cfg.hidden_size, [inter] * 2, False, method_for("mlp.gate_up_proj"), dtype,
                                   LinearShard(rows=(cols, cols)) if tp.size > 1 else None,
                                   silu_mul_after=not self.gelu)
        self.down_proj = Linear(inter, cfg.hidden_size, False, method_for("mlp.down_proj"), dtype,
                                _row_shard(tp, cols))

    def forward(self, x):
        if self.gelu:
            return self.down_proj(self.ops.gelu_mul(self.gate_up_proj(x)))
        act = self.gate_up_proj.silu_mul_output(x, self.ops.silu_mul)  # in gate_up's epilogue, where it can be
        if act is None:
            act = self.down_proj.input_from_silu_mul(self.gate_up_proj(x), self.ops.silu_mul)
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, method_for: MethodFor, attention, rope, dtype, key_transform: bool,
                 ops: TorchTokenOps, tp: TensorParallel, window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = Attention(cfg, method_for, attention, rope, dtype, key_transform, ops, tp, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm normalizes the attention's output instead
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.mlp = MLP(cfg, method_for, dtype, ops, tp)

    @property
    def mlp_input_norm(self) -> RMSNorm:
        """The norm whose output is the MLP's input (what the quantizer folds into gate_up)."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(self, positions, h, meta, cache, delta=None):
        """The residual stream h and the previous layer's output delta (not yet
        added: the add is fused into this layer's first norm) -> the new
        residual stream and this layer's MLP output."""
        # the consuming linear may fuse the norm with quantizing its input
        x, h = self.self_attn.qkv_proj.input_from_norm(self.input_layernorm, h, delta)
        a = self.self_attn(positions, x, meta, cache)
        if self.sandwich:
            a = self.post_attention_layernorm(a)
        x, h = self.mlp.gate_up_proj.input_from_norm(self.mlp_input_norm, h, a)
        m = self.mlp(x)
        return h, self.post_feedforward_layernorm(m) if self.sandwich else m


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: any float type (converted on load)


class LlamaForCausalLM(nn.Module):
    # fused linear -> the checkpoint matrices it holds, in order along its output
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                              "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, cfg: ModelArchConfig, attention: AttentionBackend | None, dtype: torch.dtype,
                 linear_method: LinearMethod | Callable[[str], LinearMethod] | None = None,
                 max_positions: int | None = None,
                 key_transform: bool = False, logits_head: LogitsHead | None = None,
                 token_ops: TorchTokenOps | None = None, tp: TensorParallel | None = None):
        """linear_method: one method for every linear, or a linear's method by its
        name ("layers.{i}.mlp.down_proj": a checkpoint that mixes schemes).
        key_transform: attention has a KeyTransform (QoQ checkpoints for KV4 carry one).
        logits_head, token_ops: the LM head's kernel and the per-token ops (default: torch).
        tp: this rank's slice under tensor parallelism (default: the whole model);
        embeddings, norms and the LM head stay whole on every rank."""
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or SINGLE
        self.logits_head = logits_head or LogitsHead()
        self.token_ops = ops = token_ops or TorchTokenOps()
        linear_method = linear_method or UnquantizedLinearMethod()
        method_for = ((lambda name: linear_method) if isinstance(linear_method, LinearMethod)
                      else linear_method)
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                         requires_grad=False)
        positions = max_positions or cfg.max_position_embeddings
        rope = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        # Gemma 3: the sliding layers turn by their own base, unscaled
        local = (RotaryEmbedding(cfg.head_dim, positions, cfg.rope_local_theta, None, cfg.rotary_dim)
                 if cfg.rope_local_theta else rope)

        def rope_of(i: int) -> RotaryEmbedding | None:
            return None if i in cfg.nope_layers else local if cfg.window_of(i) else rope
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, lambda name, i=i: method_for(f"layers.{i}.{name}"), attention,
                         rope_of(i), dtype, key_transform, ops, tp, cfg.window_of(i))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.slides = tuple(bool(cfg.window_of(i)) for i in range(cfg.num_layers))
        # lm_head and embeddings stay high precision (QoQ keeps them unquantized)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
                                     requires_grad=False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                caches: list[torch.Tensor] | None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        h, delta = self.token_ops.embed(input_ids, self.embed_tokens, self.cfg.embed_scale), None
        # the sliding layers' view of the step, once for all of them
        windowed = meta.in_window_pages()
        for i, layer in enumerate(self.layers):
            h, delta = layer(positions, h, windowed if self.slides[i] else meta,
                             caches[i] if caches is not None else None, delta)
        return self.norm(h, delta)[0]

    def release_lm_head(self) -> None:
        """Where the head computes from its own copy in another format (INT8),
        the model's untied lm_head is never read again: only its shape stays
        (a meta tensor), its bytes go back (measured: docs/benchmarks.md). The
        serving runner calls this after loading; a model that is loaded again
        (the quantizer's) keeps its weight."""
        if not self.cfg.tie_word_embeddings and self.logits_head.own_copy_only:
            self.lm_head = nn.Parameter(self.lm_head.to("meta"), requires_grad=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.logits_head(hidden, self.lm_head)
        cap = self.cfg.logit_softcap
        return self.token_ops.softcap(logits, cap) if cap else logits

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], rows: list[int] | None = None,
                      pages: list[int] | None = None, kv_caches: list[torch.Tensor] | None = None,
                      block_size: int = 0, page_map: PageMap | None = None) -> torch.Tensor:
        """fp32 logits of the next token after each position in rows (default:
        all but the last) from one causal pass ([len(rows), vocab], on the
        model's device). With pages (ids of enough free pages of kv_caches,
        and of the sliding layers' pool through page_map where it has one),
        K/V are written there and attention runs the prefill kernel over them;
        without, an uncached pass."""
        device = self.embed_tokens.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        n = len(token_ids)
        slots = tables = None
        if pages is not None:
            pos = torch.arange(n)
            slots = (torch.tensor(pages)[pos // block_size] * block_size + pos % block_size).to(device)
            tables = torch.tensor([pages], device=device)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, block_tables=tables,
                                 context_lens=None, query_starts=[0, n], cached_lens=[0],
                                 window_pages=page_map if pages is not None else None)
        hidden = self(ids, torch.arange(n, device=device), meta, kv_caches if pages is not None else None)
        # only the rows asked for reach the LM head: a long prompt scored at a few
        # answer positions never holds [len, vocab] logits
        hidden = hidden[:-1] if rows is None else hidden[torch.tensor(rows, device=device)]
        return self.compute_logits(hidden).float()

    def prompt_logprobs(self, token_ids: list[int], pages: list[int] | None = None,
                        kv_caches: list[torch.Tensor] | None = None, block_size: int = 0) -> torch.Tensor:
        """log p(token i+1 | tokens <= i) for each i ([len-1], fp32, CPU): one
        causal pass, for perplexity (pages: as in prompt_logits)."""
        return next_token_logprobs(self.prompt_logits(token_ids, None, pages, kv_caches, block_size), token_ids)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the pre-allocated parameters."""
        params = dict(self.named_parameters(remove_duplicate=False))
        seen: set[str] = set()
        for name, tensor in tensors:
            target, shard = self.map_checkpoint_name(name)
            if target is None:
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model ({target!r})")
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            with torch.no_grad():
                try:
                    if loader is not None:
                        loader(param, tensor, shard)
                    elif tuple(param.shape) != tuple(tensor.shape):
                        raise ValueError(f"shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
                    else:
                        param.copy_(materialize(tensor))
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            seen.add(f"{target}#{shard}")
        self._check_complete(seen)
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                try:
                    module.method.process_weights_after_loading(module)
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
        self.logits_head.prepare(self.lm_head)

    def map_checkpoint_name(self, name: str) -> tuple[str | None, int | None]:
        if "rotary_emb" in name:
            return None, None
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return "embed_tokens", None
        if name == "lm_head.weight":
            return ("embed_tokens" if self.cfg.tie_word_embeddings else "lm_head"), None
        for fused, parts in self.packed_modules_mapping.items():
            for shard, part in enumerate(parts):
                if f".{part}." in name:
                    return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def checkpoint_schema(self, fused_linears: bool) -> dict[str, TensorSpec]:
        """Every tensor a checkpoint for this model must hold, under HF names:
        derived from the parameters the linear methods created, so it is the
        inverse of load_weights by construction. fused_linears: fused linears'
        tensors are stored whole (qkv_proj.*) rather than per part (q_proj.*).
        Cheap on the meta device."""
        linears = {n: m for n, m in self.named_modules() if isinstance(m, Linear)}
        out = {}
        for name, p in self.named_parameters():  # the tied lm_head is listed once
            dtype = p.dtype if getattr(p, "exact_dtype", False) else None
            module, _, leaf = name.rpartition(".")
            parent, _, short = module.rpartition(".")
            if module in linears and not fused_linears and short in self.packed_modules_mapping:
                for part, size in zip(self.packed_modules_mapping[short], linears[module].output_sizes):
                    out[f"model.{parent}.{part}.{leaf}"] = TensorSpec((size, *p.shape[1:]), dtype)
            elif name in ("embed_tokens", "lm_head"):
                out[("model." if name == "embed_tokens" else "") + name + ".weight"] = \
                    TensorSpec(tuple(p.shape), dtype)
            else:
                out["model." + name] = TensorSpec(tuple(p.shape), dtype)
        return out

    def _check_complete(self, seen: set[str]) -> None:
        """Every parameter must have come from the checkpoint: torch.empty leftovers
        would otherwise compute garbage silently."""
        top = ["embed_tokens"] + ([] if self.cfg.tie_word_embeddings else ["lm_head"])
        missing = [n for n in top if f"{n}#None" not in seen]
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm) and f"{name}.weight#None" not in seen:
                missing.append(f"{name}.weight")
            if isinstance(module, KeyTransform):
                missing += [f"{name}.{p}" for p in ("shift", "rotation") if f"{name}.{p}#None" not in seen]
            if not isinstance(module, Linear):
                continue
            for pname, _ in module.named_parameters(recurse=False):
                # a fused parameter comes whole (quantized checkpoints) or one shard per part
                key = f"{name}.{pname}"
                shards = range(len(module.output_sizes))
                if f"{key}#None" not in seen and not all(f"{key}#{i}" in seen for i in shards):
                    missing.append(key)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def next_token_logprobs(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """From the logits after every position but the last: log p of each next
    token ([len-1], fp32, CPU)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(token_ids[1:], device=logprobs.device)
    return logprobs.gather(1, targets[:, None])[:, 0].cpu()
