"""Per-layer attention statistics of a trained model: the largest attention logit and the
mean attention entropy of every self- and cross-attention.

fairseq's ``MultiheadAttention`` takes a fused fast path that returns no weights unless
``need_weights`` (and the layers ask for none), so the logits are recomputed from the
module's own projections in a forward hook: ``logits = (W_q q * head_dim^-1/2) . (W_k k)``
per head, with the call's ``attn_mask`` (causal mask) and ``key_padding_mask`` applied, then
``softmax`` and the entropy ``-sum_j p_j log p_j`` of each query. Statistics are taken over
real (non-padding) query positions and every head. Key/value biases (``--add-bias-kv``)
and zero attention are not modelled.
"""
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

from fairseq_normplug.diagnostics.loading import LoadedCheckpoint, teacher_forced


def attention_modules(model) -> Dict[str, nn.Module]:
    """{name: attention module} in forward order: ``enc{i}.self``, ``dec{i}.self``,
    ``dec{i}.cross``."""
    found = {}
    for prefix, stack in (("enc", model.encoder), ("dec", model.decoder)):
        for index, layer in enumerate(stack.layers):
            for attr, kind in (("self_attn", "self"), ("encoder_attn", "cross")):
                if getattr(layer, attr, None) is not None:
                    found[f"{prefix}{index}.{kind}"] = getattr(layer, attr)
    return found


def attention_logits(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     key_padding_mask: Optional[torch.Tensor] = None,
                     attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scaled logits ``(batch, heads, queries, keys)`` of a fairseq ``MultiheadAttention`` on
    time-first ``query``/``key``; masked entries are ``-inf``."""
    target_len, batch, _ = query.shape
    heads, head_dim = module.num_heads, module.head_dim
    q = (module.q_proj(query) * module.scaling).view(target_len, batch, heads, head_dim)
    k = module.k_proj(key).view(key.shape[0], batch, heads, head_dim)
    logits = torch.einsum("tbhd,sbhd->bhts", q, k).float()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(attn_mask, float("-inf"))
        else:
            logits = logits + attn_mask.float()
    if key_padding_mask is not None:
        logits = logits.masked_fill(key_padding_mask.bool()[:, None, None, :], float("-inf"))
    return logits


def query_statistics(logits: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per query (batch, queries): the largest logit over heads and keys, and the attention
    entropy averaged over heads (nats)."""
    p = torch.softmax(logits, dim=-1)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    return {"max_logit": logits.amax(dim=(1, 3)), "entropy": entropy.mean(1)}


@contextmanager
def attention_recorder(model) -> Iterator[Dict[str, List[Dict[str, torch.Tensor]]]]:
    """Forward hooks on every attention module; yields {name: [query_statistics of each
    call]}, filled as the model runs (incremental decoding steps are skipped)."""
    records: Dict[str, list] = {name: [] for name in attention_modules(model)}

    def hook(name):
        def record(module, args, kwargs, output):
            if kwargs.get("incremental_state") is not None:
                return
            query = kwargs.get("query", args[0] if args else None)
            key = kwargs.get("key", args[1] if len(args) > 1 else None)
            logits = attention_logits(module, query, query if key is None else key,
                                      kwargs.get("key_padding_mask"), kwargs.get("attn_mask"))
            records[name].append(query_statistics(logits))
        return record

    handles = [module.register_forward_hook(hook(name), with_kwargs=True)
               for name, module in attention_modules(model).items()]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def collect_attention_statistics(loaded: LoadedCheckpoint, samples: List[dict]) -> Dict[str, Dict[str, float]]:
    """{attention name: {"max_logit": largest logit, "entropy": mean entropy (nats),
    "queries": real query positions}} over ``samples`` (teacher forcing)."""
    maxima: Dict[str, float] = {}
    entropy_sums: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    with attention_recorder(loaded.model) as records:
        for masks in teacher_forced(loaded, samples):
            for name, calls in records.items():
                mask = masks[name[:3]]
                for stats in calls:
                    maxima[name] = max(maxima.get(name, float("-inf")), float(stats["max_logit"][mask].max()))
                    entropy_sums[name] = entropy_sums.get(name, 0.0) + float(stats["entropy"][mask].sum())
                    counts[name] = counts.get(name, 0) + int(mask.sum())
                calls.clear()
    return {name: {"max_logit": maxima[name], "entropy": entropy_sums[name] / counts[name],
                   "queries": counts[name]} for name in maxima}
