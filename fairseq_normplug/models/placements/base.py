"""What every placement layer shares: fairseq's own sublayers as plain functions F(x), and the
class swap that gives a built fairseq layer a placement's forward.

A placement is a mixin that :func:`swap_layer_class` puts, with the encoder or decoder forward
below, in front of fairseq's ``TransformerEncoderLayerBase`` / ``TransformerDecoderLayerBase``
(``layer.__class__`` is swapped after the stock build, as ``modules/residual_scale.py`` does). Its ``forward`` keeps fairseq's signature and return
values and runs the sublayers through :meth:`PlacementLayer.sublayers`, which each
placement defines: it gets the layer input and the list ``[(kind, F), ...]`` with kind
``attn`` (self-attention), ``cross`` (decoder cross-attention, when present) and ``ffn``,
and says where the norms sit and how the residuals add up. The sublayers are fairseq's own
modules (``self_attn``, ``encoder_attn``, ``fc1``/``fc2``), so norm types, inits, QKNorm and
the ``residual_connection`` hook (``--residual-scale``) keep working; F(x) is returned
without dropout, the placement applies ``dropout_module`` to the branch.
"""
from typing import Callable, Dict, List, Tuple

import torch
from torch import Tensor, nn

from fairseq.modules import LayerNorm

#: the norm fairseq builds for each sublayer (PreNorm: before it, PostNorm: after the residual)
SUBLAYER_NORMS = {"attn": "self_attn_layer_norm", "cross": "encoder_attn_layer_norm", "ffn": "final_layer_norm"}

Sublayers = List[Tuple[str, Callable[[Tensor], Tensor]]]


def new_norm(dim: int, role: str) -> nn.Module:
    """An extra norm, built as fairseq builds its own (a LayerNorm); ``install_norms`` then turns
    it into the chosen ``--norm-type`` with every other norm of the model (it must be listed in
    ``norm_placement``'s slot tables)."""
    return LayerNorm(dim)


class PlacementLayer:
    """Mixin of a fairseq encoder or decoder layer whose sublayers go through ``sublayers``."""

    def sublayers(self, x: Tensor, sublayers: Sublayers) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def feed_forward(self, x: Tensor) -> Tensor:
        """fairseq's FFN block without dropout on its output: fc2(act_dropout(act(fc1(x))))."""
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        if getattr(self, "ffn_layernorm", None) is not None:
            x = self.ffn_layernorm(x)
        return self.fc2(x)

    def norm(self, kind: str) -> nn.Module:
        return getattr(self, SUBLAYER_NORMS[kind])


class PlacementEncoderLayer(PlacementLayer):
    """``TransformerEncoderLayerBase.forward`` with the sublayers run by ``sublayers``."""

    def forward(self, x, encoder_padding_mask, attn_mask=None):
        if attn_mask is not None:  # as fairseq does
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4)

        def self_attention(h):
            out = self.self_attn(query=h, key=h, value=h, key_padding_mask=encoder_padding_mask,
                                 need_weights=False, attn_mask=attn_mask)[0]
            attn_ln = getattr(self, "attn_ln", None)  # NormFormer's post-attention norm
            return out if attn_ln is None else attn_ln(out)

        return self.sublayers(x, [("attn", self_attention), ("ffn", self.feed_forward)])


class PlacementDecoderLayer(PlacementLayer):
    """``TransformerDecoderLayerBase.forward`` (incremental state, cached self-attention keys,
    cross-self-attention, attention weights) with the sublayers run by ``sublayers``."""

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                prev_self_attn_state=None, prev_attn_state=None, self_attn_mask=None,
                self_attn_padding_mask=None, need_attn: bool = False, need_head_weights: bool = False):
        if need_head_weights:
            need_attn = True
        weights: Dict[str, Tensor] = {}

        def self_attention(h):
            mask, padding = self_attn_mask, self_attn_padding_mask
            if prev_self_attn_state is not None:
                saved = {"prev_key": prev_self_attn_state[0], "prev_value": prev_self_attn_state[1]}
                if len(prev_self_attn_state) >= 3:
                    saved["prev_key_padding_mask"] = prev_self_attn_state[2]
                self.self_attn._set_input_buffer(incremental_state, saved)
            buffer = self.self_attn._get_input_buffer(incremental_state)
            if self.cross_self_attention and not (incremental_state is not None and buffer is not None
                                                  and "prev_key" in buffer):
                if mask is not None:
                    mask = torch.cat((h.new_zeros(h.size(0), encoder_out.size(0)), mask), dim=1)
                if padding is not None:
                    enc_padding = encoder_padding_mask
                    if enc_padding is None:
                        enc_padding = padding.new_zeros(encoder_out.size(1), encoder_out.size(0))
                    padding = torch.cat((enc_padding, padding), dim=1)
                y = torch.cat((encoder_out, h), dim=0)
            else:
                y = h
            out, _ = self.self_attn(query=h, key=y, value=y, key_padding_mask=padding,
                                    incremental_state=incremental_state, need_weights=False, attn_mask=mask)
            if self.c_attn is not None:
                tgt_len, bsz = out.size(0), out.size(1)
                out = torch.einsum("tbhd,h->tbhd", out.view(tgt_len, bsz, self.nh, self.head_dim), self.c_attn)
                out = out.reshape(tgt_len, bsz, self.embed_dim)
            if self.attn_ln is not None:
                out = self.attn_ln(out)
            return out

        def cross_attention(h):
            if prev_attn_state is not None:
                saved = {"prev_key": prev_attn_state[0], "prev_value": prev_attn_state[1]}
                if len(prev_attn_state) >= 3:
                    saved["prev_key_padding_mask"] = prev_attn_state[2]
                self.encoder_attn._set_input_buffer(incremental_state, saved)
            out, attn = self.encoder_attn(query=h, key=encoder_out, value=encoder_out,
                                          key_padding_mask=encoder_padding_mask,
                                          incremental_state=incremental_state, static_kv=True,
                                          need_weights=need_attn or (not self.training and self.need_attn),
                                          need_head_weights=need_head_weights)
            weights["attn"] = attn
            return out

        sublayers: Sublayers = [("attn", self_attention)]
        if self.encoder_attn is not None and encoder_out is not None:
            sublayers.append(("cross", cross_attention))
        sublayers.append(("ffn", self.feed_forward))
        x = self.sublayers(x, sublayers)
        return x, weights.get("attn"), None


_CLASSES: Dict[Tuple[type, type], type] = {}


def swap_layer_class(layer: nn.Module, mixin: type) -> None:
    """Put the placement's ``mixin`` (its ``sublayers``) and the encoder or decoder forward
    (:class:`PlacementEncoderLayer` / :class:`PlacementDecoderLayer`) in front of ``layer``'s
    class; e.g. ``B2TLayer`` on fairseq's decoder layer gives ``B2TDecoderLayer...``."""
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

    decoder = isinstance(layer, TransformerDecoderLayerBase)
    cls = type(layer)
    if (mixin, cls) not in _CLASSES:
        stack_forward = PlacementDecoderLayer if decoder else PlacementEncoderLayer
        name = mixin.__name__.removesuffix("Layer") + ("DecoderLayer" if decoder else "EncoderLayer") + cls.__name__
        _CLASSES[(mixin, cls)] = type(name, (mixin, stack_forward, cls), {})
    layer.__class__ = _CLASSES[(mixin, cls)]


def set_final_norm(stack: nn.Module, norm) -> None:
    """Give ``stack`` PreNorm's final norm ``layer_norm`` (or remove it: ``norm=None``), at the
    place fairseq registers it (right after ``layers``), so parameter names and their order
    are those of a stock PreNorm stack."""
    stack.__dict__.pop("layer_norm", None)  # fairseq's PostNorm stack: a plain None attribute
    modules = [(name, module) for name, module in stack._modules.items() if name != "layer_norm"]
    stack._modules.clear()
    for name, module in modules:
        stack._modules[name] = module
        if name == "layers" and norm is not None:
            stack._modules["layer_norm"] = norm
    if norm is None:
        stack.layer_norm = None


def stacks(model):
    """(encoder, decoder) of ``model``."""
    return model.encoder, model.decoder
