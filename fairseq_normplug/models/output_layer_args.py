"""Flags of the output layer in the authors' recipe (tnq177/transformers_without_tears
``model.py``): ``--target-vocab-mask`` (their ``mask_logit``) and ``--output-bias`` (their
``out_bias``). Both default off, and off the model is stock. Validated with the other plugin
flags at argument-parse time."""
from dataclasses import dataclass

from fairseq_normplug.errors import NormplugError

OUTPUT_LAYER_DEFAULTS = {"target_vocab_mask": False, "output_bias": False}
#: the criterion that spreads label smoothing over the allowed types only
MASKED_CRITERION = "masked_label_smoothed_cross_entropy"


def add_output_layer_args(add) -> None:
    """Add the flags through ``add`` (an argument group's add_argument)."""
    add("--target-vocab-mask", action="store_true",
        help="never give probability to a type that does not occur on the target side of the "
             "training data (plus </s>, <unk>): their logits are set to -1e9 (float16: -65504); "
             "the allowed types are read from the data dir's binarized training targets and saved "
             f"in the checkpoint; with label smoothing use --criterion {MASKED_CRITERION}")
    add("--output-bias", action="store_true",
        help="a learnable bias per vocabulary type on the output layer, initialised to 0 (the "
             "authors' out_bias); fairseq's output layer has none")


@dataclass(frozen=True)
class OutputLayerSettings:
    target_vocab_mask: bool
    output_bias: bool


def resolve_output_layer_args(args) -> OutputLayerSettings:
    """Refuse the combinations that cannot work (``args`` read only, with
    :data:`OUTPUT_LAYER_DEFAULTS` filled in)."""
    adaptive = getattr(args, "adaptive_softmax_cutoff", None)
    for flag, on in (("--target-vocab-mask", args.target_vocab_mask), ("--output-bias", args.output_bias)):
        if on and adaptive:
            raise NormplugError(f"{flag} cannot be combined with --adaptive-softmax-cutoff {adaptive} "
                                f"(the adaptive softmax has no single output layer)")
    criterion = getattr(args, "criterion", None) or ""
    smoothing = getattr(args, "label_smoothing", 0.0) or 0.0
    if args.target_vocab_mask and "label_smoothed" in criterion and criterion != MASKED_CRITERION \
            and smoothing > 0:
        raise NormplugError(
            f"--target-vocab-mask cannot be combined with --criterion {criterion} --label-smoothing "
            f"{smoothing:g}: it spreads the smoothing over the whole vocabulary, masked types "
            f"included; use --criterion {MASKED_CRITERION} (smoothing over the allowed types only)")
    return OutputLayerSettings(target_vocab_mask=args.target_vocab_mask, output_bias=args.output_bias)
