"""fairseq-normplug: the normalization choices of "Transformers without Tears"
(Nguyen & Salazar 2019) and "Transformers without Normalization" (Zhu et al. 2025)
as a fairseq user-dir plugin.

Load it with ``fairseq-train --user-dir fairseq_normplug`` (from the repository root) or
``--user-dir "$(fairseq-normplug-path)"`` after ``pip install``. Importing the package
registers the ``transformer_normplug`` model with its presets, the ``inv_sqrt_decay`` /
``val_decay`` learning-rate schedulers, the ``translation_normplug`` task and the
``masked_label_smoothed_cross_entropy`` criterion, allow-lists the classes fairseq checkpoints
hold so that they load under torch >= 2.6's ``weights_only`` default, and applies the plugin's
three wrappers of fairseq functions (:mod:`fairseq_normplug.fairseq_patches`, pass-throughs
until a model or lr scheduler asks for their effect).
"""


def _only_printing_the_path() -> bool:
    """Whether this process is ``fairseq-normplug-path`` (:func:`fairseq_normplug.cli.print_user_dir`),
    which prints this folder's path and nothing else: it imports neither torch nor fairseq and
    registers nothing, so that each ``--user-dir "$(fairseq-normplug-path)"`` of a command costs a
    few milliseconds, not the 3 CPU seconds of importing them."""
    import os
    import sys

    program = os.path.basename((getattr(sys, "argv", None) or [""])[0])
    return program.removesuffix(".exe").removesuffix("-script.py") == "fairseq-normplug-path"


if not _only_printing_the_path():
    from fairseq_normplug.install_plan import check_requirements

    check_requirements()  # one line naming the fix when fairseq is missing or torch is too old

    from fairseq_normplug.checkpoint_compat import allow_fairseq_checkpoint_classes  # noqa: E402
    from fairseq_normplug.errors import NormplugError, install_one_line_errors  # noqa: E402
    from fairseq_normplug import fairseq_patches  # noqa: E402

    allow_fairseq_checkpoint_classes()
    install_one_line_errors()
    fairseq_patches.install()

    from fairseq_normplug import models  # noqa: E402,F401  (registers the model)
    from fairseq_normplug import optim  # noqa: E402,F401  (registers the LR schedulers)
    from fairseq_normplug import tasks  # noqa: E402,F401  (registers the translation_normplug task)
    from fairseq_normplug import criterions  # noqa: E402,F401  (registers masked_label_smoothed_cross_entropy)
    from fairseq_normplug.modules.norm_base import FormulaNorm  # noqa: E402
    from fairseq_normplug.modules.norm_registry import ATTENTION, FFN, FINAL, register_norm  # noqa: E402
    from fairseq_normplug.models.placements import (  # noqa: E402
        SUBLAYER_NORMS, Modifier, Placement, new_norm, register_modifier, register_placement, slot_norm,
    )
    # helpers the built-in designs use, for extensions too: float32 scalars and statistics under
    # fp16/bf16, a parameter-free norm, a flag's spelling, a numeric flag's range, a sum over the data-parallel ranks
    from fairseq_normplug.modules.float32_params import HALF_DTYPES, Float32Params  # noqa: E402
    from fairseq_normplug.modules.fused import upcast  # noqa: E402
    from fairseq_normplug.modules.identity_norm import IdentityNorm  # noqa: E402
    from fairseq_normplug.modules.auto_init import sum_over_ranks  # noqa: E402
    from fairseq_normplug.modules.mixins import mix_into  # noqa: E402  (a behaviour added to a module in place)
    from fairseq_normplug.models.placements.base import flag  # noqa: E402
    from fairseq_normplug.numeric_flags import number_flag  # noqa: E402  (a numeric flag: finite, in its range)
    # what a placement can declare about its layers, and PreNorm's declarations (a modifier's ``requires``)
    from fairseq_normplug.models.placements.base import CAPABILITIES, PRENORM_LIKE  # noqa: E402
    from fairseq_normplug.extensions import load_startup_extensions  # noqa: E402

    # a researcher's own norms and placements (docs/extending.md): installed packages' entry points,
    # $NORMPLUG_MODULES and --normplug-modules, before fairseq parses the model's arguments
    load_startup_extensions()

__all__ = ["NormplugError", "FormulaNorm", "register_norm", "Placement", "Modifier", "register_placement",
           "register_modifier", "new_norm", "slot_norm", "ATTENTION", "FFN", "FINAL", "SUBLAYER_NORMS", "Float32Params",
           "HALF_DTYPES", "upcast", "IdentityNorm", "sum_over_ranks", "flag", "number_flag", "CAPABILITIES",
           "PRENORM_LIKE", "mix_into"]
__version__ = "0.1.0"
