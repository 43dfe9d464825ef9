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

Which parameters count is the model's rule,
:func:`fairseq_normplug.models.norm_parameters.norm_parameter_names` (its docstring is the
rule); this module consumes its list. :func:`mark_norm_parameters` (called once by
``transformer_normplug``'s ``build_model`` when the flag is given) puts each of them in a
param group with ``weight_decay = WD`` through
:func:`fairseq_normplug.fairseq_patches.set_param_group`, so the optimizer gets two groups,
``[{"params": others}, {"params": norm parameters, "weight_decay": WD}]``, both in
``model.parameters()`` order, under fp32, ``--bf16``, ``--fp16 --fp16-no-flatten-grads``,
``--memory-efficient-fp16/-bf16`` and ``--amp`` (how, and why that takes a wrapper of
fairseq's optimizer builder: :mod:`fairseq_normplug.fairseq_patches`). The optimizer is the
stock one (``FairseqAdam``, the same class name in checkpoints), with two groups.
:func:`check_norm_weight_decay_args` refuses, at argument-parse time, the set-ups where one
tensor holds every parameter (flat ``--fp16``, FSDP) or the optimizer has no per-group decay.

Data-parallel ranks: the groups depend only on the model's structure (module types and
parameter names), never on data or random state, so every rank builds the same groups in the
same order, and the optimizer state dicts (and fairseq's broadcast/sharded variants) match.

Resume: fairseq's checkpoint stores the torch optimizer state with both groups; torch's
``Optimizer.load_state_dict`` restores them group by group (sizes must match, which they do
for the same model and flags), including each group's ``weight_decay`` - the checkpoint's
values win over the command line, exactly as stock fairseq treats ``--weight-decay``.
"""
import logging
from typing import List, Optional, Sequence

from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.fairseq_patches import param_group_options, set_param_group

#: fairseq's optimizers whose update reads ``group["weight_decay"]`` per param group
GROUP_WEIGHT_DECAY_OPTIMIZERS = ("adadelta", "adafactor", "adagrad", "adam", "adamax", "cpu_adam",
                                 "lamb", "nag", "sgd")
logger = logging.getLogger(__name__)


def norm_weight_decay_of(p) -> Optional[float]:
    """The weight decay :func:`mark_norm_parameters` gave ``p``, or None."""
    return (param_group_options(p) or {}).get("weight_decay")


def mark_norm_parameters(model: nn.Module, names: Sequence[str], weight_decay: float) -> List[str]:
    """Give the parameters ``names`` of ``model`` (the model's norm parameters) their own
    optimizer param group with ``weight_decay``. Returns ``names`` as a list."""
    params = dict(model.named_parameters())
    for name in names:
        set_param_group(params[name], weight_decay=float(weight_decay))
    logger.info(f"--norm-weight-decay {float(weight_decay)}: {len(names)} norm/gain parameters "
                f"({sum(params[n].numel() for n in names)} elements) in their own optimizer param group")
    return list(names)


def check_norm_weight_decay_args(args) -> Optional[float]:
    """Validate ``--norm-weight-decay`` against the other flags on ``args`` (the full
    training namespace; flags it lacks, e.g. in a bare model build, are not checked) and
    return it as a float, or None when not given."""
    value = getattr(args, "norm_weight_decay", None)
    if value is None:
        return None
    value = float(value)  # finite and >= 0: declared with the flag (models/beyond_args.py)
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

