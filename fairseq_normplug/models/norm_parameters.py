"""Which parameters are norm parameters: the model-side rule that ``--norm-weight-decay``
(:mod:`fairseq_normplug.optim.norm_weight_decay`) gives its own weight decay."""
from typing import List

from torch import nn

from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.placements.hyper_connections import HyperConnection
from fairseq_normplug.models.placements.normformer import HeadScaledProjection
from fairseq_normplug.modules.qknorm import HeadNormProjection
from fairseq_normplug.modules.residual_scale import ResidualScale


def norm_parameter_names(model: nn.Module) -> List[str]:
    """Names (as in ``model.named_parameters()``) of the norm parameters and gains, in
    ``model.parameters()`` order. The rule:

    1. every parameter of every norm module: the modules of
       :func:`fairseq_normplug.models.norm_placement.norm_slots` (per layer
       ``self_attn_layer_norm``, ``encoder_attn_layer_norm``, ``final_layer_norm``, NormFormer's
       ``attn_ln``/``ffn_layernorm``, the stacks' ``layer_norm`` and ``layernorm_embedding``,
       and whatever norms ``--norm-placement`` adds there), whatever the ``--norm-type``:
       LayerNorm's weight *and bias*, ScaleNorm's g, RMSNorm's weight, DyT's alpha, gamma
       (weight) and beta (bias), Derf's alpha and shift, DyISRU's beta, ...;
    2. the plugin's gains outside the norms: every parameter of a ``--residual-scale``
       module (ReZero's per-sublayer scalars, LayerScale's per-channel diag, shape
       ``(sublayers, d)``, Admin's omega), QKNorm's scalar ``q_proj.g``, NormFormer's
       per-head ``out_proj.head_scale`` and the hyper-connections' static mixing coefficients
       and scales (``HyperConnection.gains``; their dynamic projections are weight matrices);
    3. every other 0-dim parameter (a learnable scalar), e.g. ``--embed-scale learnable``'s
       ``encoder.embed_scale`` / ``decoder.embed_scale``: stock fairseq has none, so only
       scalar gains/scales can match.

    Not included: weight matrices, embeddings (FixNorm's too: FixNorm has no scale of its own,
    its scale is the output norm's g, included by 1.) and the biases of Linear layers
    (attention/FFN projections, ``--output-bias``): they keep ``--weight-decay``, as in stock
    fairseq. Frozen parameters (``requires_grad=False``, e.g. ``--scalenorm-fixed-g``) are
    listed but never reach the optimizer. Only module types and names decide, so every
    data-parallel rank gets the same list.
    """
    chosen = set()
    for norm in named_norms(model).values():
        chosen.update(id(p) for p in norm.parameters())
    for module in model.modules():
        if isinstance(module, ResidualScale):
            chosen.update(id(p) for p in module.parameters())
        elif isinstance(module, HeadNormProjection) and module.g is not None:
            chosen.add(id(module.g))
        elif isinstance(module, HeadScaledProjection):
            chosen.add(id(module.head_scale))
        elif isinstance(module, HyperConnection):
            chosen.update(id(p) for p in module.gains())
    return [name for name, p in model.named_parameters() if id(p) in chosen or p.dim() == 0]
