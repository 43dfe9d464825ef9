"""Where the norms of a Transformer layer sit and how its residuals add up (``--norm-placement``),
registered in one place: ``PLACEMENTS`` maps each name to the function that turns a freshly
built stock fairseq model (PostNorm, or PreNorm for ``pre``) into that placement.

* ``post``: x <- LN(x + F(x)), fairseq's PostNorm; ``pre``: x <- x + F(LN(x)) plus a final norm
  per stack, fairseq's PreNorm (``--encoder/decoder-normalize-before``). Both are the stock
  model as built (nothing is installed).
* ``sandwich`` (Peri-LN), ``mix`` (Mix-LN), ``b2t`` (B2T connection), ``resi-dual``
  (ResiDual), ``hybrid`` (HybridNorm): one module each, with the paper and formula in its
  docstring.
* ``--normformer`` (NormFormer, on top of ``pre``): a norm after self-attention, per-head
  scales before the attention's output projection and a norm after the FFN's activation
  (``normformer.py``), installed by :func:`install_normformer`.

Adding a placement: one small module with ``install(model, settings)`` (a layer mixin defining
``sublayers``, put on each layer by ``base.swap_layer_class``), one line
here (and one in ``PLACEMENT_INITS`` if its authors change the init), its new norm attributes in ``models/norm_placement.py``'s slot tables, and its refusals
in ``models/placement_args.py``. Extra norms are built as LayerNorms and converted with all
others by ``install_norms``, so every ``--norm-type`` works.
"""
from typing import Callable, Dict

from fairseq_normplug.models.placements import b2t, hybrid, mix, normformer, resi_dual, sandwich
from fairseq_normplug.models.placements.layernorm_scaling import install_layernorm_scaling


def _stock(model, settings) -> None:
    """``post`` and ``pre`` are fairseq's own layers as built."""


PLACEMENTS: Dict[str, Callable] = {
    "post": _stock,
    "pre": _stock,
    "sandwich": sandwich.install,
    "resi-dual": resi_dual.install,
    "b2t": b2t.install,
    "mix": mix.install,
    "hybrid": hybrid.install,
}
PLACEMENT_NAMES = tuple(PLACEMENTS)
#: the placements whose authors change the init (applied after ``--weight-init``)
PLACEMENT_INITS: Dict[str, Callable] = {"b2t": b2t.rescale_init}


def install_placement(model, settings) -> None:
    """Give ``model`` (just built by fairseq) the placement ``settings.placement``
    (a :class:`fairseq_normplug.models.placement_args.PlacementSettings`)."""
    PLACEMENTS[settings.placement](model, settings)


def install_normformer(model, settings) -> None:
    """``--normformer``: NormFormer's norms and head scales on the PreNorm ``model`` (nothing
    without the flag; ``placement_args`` refuses it with any other placement)."""
    if settings.normformer:
        normformer.install(model)


def apply_placement_init(model, settings) -> None:
    """The placement's own init step, if it has one (``PLACEMENT_INITS``)."""
    init = PLACEMENT_INITS.get(settings.placement)
    if init is not None:
        init(model)


__all__ = ["PLACEMENTS", "PLACEMENT_NAMES", "PLACEMENT_INITS", "install_placement", "apply_placement_init",
           "install_layernorm_scaling", "install_normformer"]
