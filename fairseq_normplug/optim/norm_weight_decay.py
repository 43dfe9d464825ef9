"""``--norm-weight-decay WD``: a separate weight decay for norm parameters and scalar gains.

fairseq's optimizers apply one ``--weight-decay`` to every parameter, so the gains and biases
of the norms (LayerNorm's gamma/beta, ScaleNorm's g, DyT's alpha, ...) and the plugin's
scalar/per-channel gains (ReZero, LayerScale, QKNorm's g, the learnable embedding scale) are
decayed towards 0 like weight matrices. Decaying a gain that multiplies a normalised signal
shrinks the signal instead of regularising a mapping; the usual practice (BERT's
``no_decay = ["bias", "LayerNorm.weight"]``, HF transformers PR #35927, ReZero issue #14,
timm/nanoGPT: "params with dim < 2 are not decayed") is to exclude them. With fairseq's
``adam`` the decay is decoupled (AdamW, Loshchilov & Hutter 2019, "Decoupled Weight Decay
Regularization", Algorithm 2 line 12): ``p <- p - lr * wd * p - lr * adam_step``, so
``--norm-weight-decay 0`` leaves those parameters to the gradient alone.

Which parameters count: :func:`norm_parameter_names` (its docstring is the rule).

How the two weights decays reach the optimizer (two param groups, the second with
``weight_decay = WD``):

1. :func:`mark_norm_parameters` (called once by ``transformer_normplug``'s ``build_model``)
   tags each such parameter with ``p.optim_overrides = {NORM_WEIGHT_DECAY_KEY: WD}``.
   ``optim_overrides`` is fairseq's own per-parameter optimizer attribute: it is the one
   attribute (with ``param_group``) that ``FP16Optimizer.build_fp32_params`` copies to the
   fp32 master copies, so the tag survives ``--bf16`` and ``--fp16 --fp16-no-flatten-grads``;
   under fp32, ``--memory-efficient-fp16/-bf16`` and ``--amp`` the optimizer gets the model's
   parameter objects themselves (``.half()``/``.to()`` keep the objects, and their attributes).
2. :func:`split_param_groups` turns a list of tagged and untagged tensors into
   ``[{"params": untagged}, {"params": tagged, "weight_decay": WD}]`` (both in the order the
   trainer passed them, i.e. ``model.parameters()`` order), and :func:`install` makes
   fairseq's ``fairseq.optim._build_optimizer`` call it.

Why a patch, and why of that function. ``Trainer._build_optimizer`` hands the optimizer a flat
list of tensors, ``chain(model.parameters(), criterion.parameters())``, with no names and no
model or task hook in between; fairseq's per-parameter mechanism (``p.param_group`` /
``p.optim_overrides``) is read only by ``--optimizer composite``, which needs a YAML config
with one optimizer and lr scheduler per group. ``fairseq.optim._build_optimizer`` (the
registry's builder) is the one point every path goes through: fp32
(``optim.build_optimizer``), ``FP16Optimizer`` (on its fp32 copies),
``MemoryEfficientFP16Optimizer`` and ``AMPOptimizer`` all call ``fairseq.optim.build_optimizer``,
which unpacks fp16's flat dict, drops ``requires_grad=False`` tensors and then calls
``_build_optimizer`` through the module's globals, so replacing that one module attribute
reaches all of them, after the filtering. The wrapper changes nothing unless at least one
tensor it receives carries the tag, so it is a pass-through for every other model; it is
installed only when ``--norm-weight-decay`` is given (idempotent; :func:`uninstall` restores
the original). No fairseq class or method is changed; the optimizer is stock ``FairseqAdam``
(same class name in checkpoints), with two groups.

Data-parallel ranks: the groups depend only on the model's structure (module types and
parameter names), never on data or random state, so every rank builds the same groups in the
same order, and the optimizer state dicts (and fairseq's broadcast/sharded variants) match.

Resume: fairseq's checkpoint stores the torch optimizer state with both groups; torch's
``Optimizer.load_state_dict`` restores them group by group (sizes must match, which they do
for the same model and flags), including each group's ``weight_decay`` - the checkpoint's
values win over the command line, exactly as stock fairseq treats ``--weight-decay``.
"""
import functools
import logging
import math
from typing import List, Optional, Sequence

import torch
from torch import nn

from fairseq_normplug.errors import NormplugError

#: the key of ``p.optim_overrides`` that holds a norm parameter's weight decay
NORM_WEIGHT_DECAY_KEY = "normplug_norm_weight_decay"
#: fairseq's optimizers whose update reads ``group["weight_decay"]`` per param group
GROUP_WEIGHT_DECAY_OPTIMIZERS = ("adadelta", "adafactor", "adagrad", "adam", "adamax", "cpu_adam",
                                 "lamb", "nag", "sgd")
_MARK = "_normplug_norm_weight_decay"
logger = logging.getLogger(__name__)


def norm_parameter_names(model: nn.Module) -> List[str]:
    """Names (as in ``model.named_parameters()``) of the parameters ``--norm-weight-decay``
    applies to, in ``model.parameters()`` order. The rule:

    1. every parameter of every norm module: the modules of
       :func:`fairseq_normplug.models.norm_placement.norm_slots` (per layer
       ``self_attn_layer_norm``, ``encoder_attn_layer_norm``, ``final_layer_norm``, NormFormer's
       ``attn_ln``/``ffn_layernorm``, the stacks' ``layer_norm`` and ``layernorm_embedding``,
       and whatever norms ``--norm-placement`` adds there), whatever the ``--norm-type``: LayerNorm's weight *and bias*, ScaleNorm's g, RMSNorm's
       weight, DyT's alpha, gamma (weight) and beta (bias), Derf's alpha and shift, DyISRU's
       beta, ...;
    2. the plugin's gains outside the norms: every parameter of a ``--residual-scale``
       module (ReZero's per-sublayer scalars, LayerScale's per-channel diag, shape
       ``(sublayers, d)``, Admin's omega), QKNorm's scalar ``q_proj.g`` and NormFormer's
       per-head ``out_proj.head_scale``;
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
    from fairseq_normplug.models.norm_placement import named_norms
    from fairseq_normplug.models.placements.normformer import HeadScaledProjection
    from fairseq_normplug.modules.qknorm import HeadNormProjection
    from fairseq_normplug.modules.residual_scale import ResidualScale

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
    return [name for name, p in model.named_parameters() if id(p) in chosen or p.dim() == 0]


def norm_weight_decay_of(p: torch.Tensor) -> Optional[float]:
    """The ``--norm-weight-decay`` tagged on ``p`` by :func:`mark_norm_parameters`, or None."""
    overrides = getattr(p, "optim_overrides", None)
    return overrides.get(NORM_WEIGHT_DECAY_KEY) if isinstance(overrides, dict) else None


def mark_norm_parameters(model: nn.Module, weight_decay: Optional[float]) -> List[str]:
    """Tag the parameters of :func:`norm_parameter_names` with ``weight_decay`` and install
    the optimizer hook; ``None`` (the flag absent) does nothing, so the optimizer stays stock
    (one param group). Returns the tagged names."""
    if weight_decay is None:
        return []
    names = norm_parameter_names(model)
    params = dict(model.named_parameters())
    for name in names:
        p = params[name]
        overrides = getattr(p, "optim_overrides", None)
        p.optim_overrides = {**(overrides if isinstance(overrides, dict) else {}),
                             NORM_WEIGHT_DECAY_KEY: float(weight_decay)}
    install()
    logger.info(f"--norm-weight-decay {float(weight_decay)}: {len(names)} norm/gain parameters "
                f"({sum(params[n].numel() for n in names)} elements) in their own optimizer param group")
    return names


def split_param_groups(params: Sequence) -> list:
    """``params`` (the tensors fairseq hands an optimizer) as two param groups when some are
    tagged: ``[{"params": untagged}, {"params": tagged, "weight_decay": WD}]``; unchanged
    (a list) when none is tagged or when they are param-group dicts already."""
    params = list(params)
    if not params or not all(isinstance(p, torch.Tensor) for p in params):
        return params
    tagged = [p for p in params if norm_weight_decay_of(p) is not None]
    if not tagged:
        return params
    decays = sorted({norm_weight_decay_of(p) for p in tagged})
    if len(decays) > 1:
        raise NormplugError(f"parameters tagged with different --norm-weight-decay values {decays}; "
                            f"build one model per optimizer")
    others = [p for p in params if norm_weight_decay_of(p) is None]
    return [{"params": others}, {"params": tagged, "weight_decay": decays[0]}]


def _wrap(original):
    @functools.wraps(original)
    def _build_optimizer(cfg, params, *extra_args, **extra_kwargs):
        return original(cfg, split_param_groups(params), *extra_args, **extra_kwargs)

    setattr(_build_optimizer, _MARK, True)
    return _build_optimizer


def is_installed() -> bool:
    import fairseq.optim

    return getattr(fairseq.optim._build_optimizer, _MARK, False)


def install() -> None:
    """Make ``fairseq.optim._build_optimizer`` split tagged parameters into their own group."""
    import fairseq.optim

    if not is_installed():
        fairseq.optim._build_optimizer = _wrap(fairseq.optim._build_optimizer)


def uninstall() -> None:
    """Put fairseq's own ``_build_optimizer`` back (for tests)."""
    import fairseq.optim

    if is_installed():
        fairseq.optim._build_optimizer = fairseq.optim._build_optimizer.__wrapped__


def check_norm_weight_decay_args(args) -> Optional[float]:
    """Validate ``--norm-weight-decay`` against the other flags on ``args`` (the full
    training namespace; flags it lacks, e.g. in a bare model build, are not checked) and
    return it as a float, or None when not given."""
    value = getattr(args, "norm_weight_decay", None)
    if value is None:
        return None
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise NormplugError(f"--norm-weight-decay must be a finite number >= 0, got {value}")
    optimizer = getattr(args, "optimizer", None)
    if isinstance(optimizer, str) and optimizer not in GROUP_WEIGHT_DECAY_OPTIMIZERS:
        raise NormplugError(
            f"--norm-weight-decay needs an optimizer with a per-param-group weight decay; "
            f"--optimizer {optimizer} is not one (choose from {', '.join(GROUP_WEIGHT_DECAY_OPTIMIZERS)}"
            + ("; with composite, set weight_decay per group in its config" if optimizer == "composite" else "")
            + ")")
    if getattr(args, "ddp_backend", None) == "fully_sharded":
        raise NormplugError(
            "--norm-weight-decay cannot be combined with --ddp-backend fully_sharded: FSDP flattens "
            "all parameters into one tensor, one weight decay; use --ddp-backend c10d (or legacy_ddp)")
    flat_fp16 = (getattr(args, "fp16", False) and not getattr(args, "bf16", False)
                 and not getattr(args, "amp", False)
                 and not getattr(args, "memory_efficient_fp16", False)
                 and not getattr(args, "memory_efficient_bf16", False)
                 and not getattr(args, "fp16_no_flatten_grads", False))
    if flat_fp16:
        raise NormplugError(
            "--norm-weight-decay with --fp16 needs --fp16-no-flatten-grads: fairseq's --fp16 "
            "optimizer keeps all fp32 master weights in one flat tensor, one weight decay; add "
            "--fp16-no-flatten-grads, or use --memory-efficient-fp16 or --amp")
    overrides = _literal(getattr(args, "optimizer_overrides", None))
    if isinstance(overrides, dict) and "weight_decay" in overrides:
        raise NormplugError(
            f"--optimizer-overrides {getattr(args, 'optimizer_overrides')} sets weight_decay on every "
            f"param group, overwriting --norm-weight-decay {value}; drop one of them "
            f"(or use --reset-optimizer to change the weight decays of a resumed run)")
    return value


def _literal(text):
    import ast

    if not isinstance(text, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None

