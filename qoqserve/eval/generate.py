"""Greedy generation straight on an in-memory model (the fake-quant
simulation of a configuration, or the FP model), over its own KV pages.

The quality table measures configurations that exist only in memory, with no
engine around them; this is the smallest loop that decodes them: one batched
prefill of all prompts, then one decode step for every unfinished prompt at a
time, on pages of the model's own KV layout (KV4 included: decode reads
K/V as stored, exactly as prefill attended to them).
"""
from __future__ import annotations

import torch

from qoqserve.layers.attention import AttentionMetadata
from qoqserve.models.llama import LlamaForCausalLM

BLOCK = 16


@torch.inference_mode()
def greedy_generate(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                    eos_ids: list[int]) -> list[list[int]]:
    """Each prompt's greedy continuation, up to and including the first EOS."""
    device = model.embed_tokens.device
    layout = model.layers[0].self_attn.attn.layout
    width = -(-(max(map(len, prompts)) + max_new_tokens) // BLOCK)
    caches = [layout.allocate(width * len(prompts), device) for _ in model.layers]
    tables = torch.arange(width * len(prompts), device=device).reshape(len(prompts), width)

    def slots(seq: int, positions) -> list[int]:
        return [int(tables[seq, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]

    ids = [t for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    starts = [0]
    for p in prompts:
        starts.append(starts[-1] + len(p))
    flat_slots = [s for i, p in enumerate(prompts) for s in slots(i, range(len(p)))]
    meta = AttentionMetadata(True, torch.tensor(flat_slots, device=device), tables, None,
                             starts, [0] * len(prompts))
    hidden = model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta, caches)
    last = model.compute_logits(hidden[torch.tensor(starts[1:], device=device) - 1]).argmax(-1).tolist()
    outs = [[t] for t in last]
    lengths = [len(p) + 1 for p in prompts]
    active = [i for i, t in enumerate(last) if t not in eos_ids]
    while active and len(outs[active[0]]) < max_new_tokens:
        step_ids = [outs[i][-1] for i in active]
        pos = [lengths[i] - 1 for i in active]
        meta = AttentionMetadata(False, torch.tensor([slots(i, [p])[0] for i, p in zip(active, pos)],
                                                     device=device),
                                 tables[torch.tensor(active, device=device)], torch.tensor(
                                     [lengths[i] for i in active], device=device))
        hidden = model(torch.tensor(step_ids, device=device), torch.tensor(pos, device=device), meta, caches)
        nxt = model.compute_logits(hidden).argmax(-1).tolist()
        for i, t in zip(active, nxt):
            outs[i].append(t)
            lengths[i] += 1
        active = [i for i in active if outs[i][-1] not in eos_ids]
    return outs
