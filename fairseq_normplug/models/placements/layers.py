"""Placements built where fairseq builds layers: the encoder's ``build_encoder_layer`` and the
decoder's ``build_decoder_layer`` hooks.

:class:`LayerPlan` is the resolved placement with its modifiers. :class:`PlacedEncoder` and
:class:`PlacedDecoder` are fairseq's ``TransformerEncoderBase`` / ``TransformerDecoderBase``
taking the plan as a constructor argument: their hooks build each layer from the plan (the
layer class, the placement's and modifiers' ``build_layer``) and then wrap it exactly as
fairseq does (``--checkpoint-activations`` / ``--offload-activations``, FSDP), so the wrapper
captures the placement's forward; once a stack is built, the designs' ``build_stack`` runs.

The norms are built, not patched: the build's norm factory (``models/norm_factory.py``) comes
with the plan, and each layer leaves :meth:`LayerPlan.build_layer` with its final norms (the
designs build theirs with ``slot_norm``; fairseq's own, built inline, are filled before the
layer is wrapped), each stack's own norms (``layer_norm``, ``layernorm_embedding``) are filled
once its designs' ``build_stack`` ran.

A placement's layers run :class:`PlacementEncoderLayer` / :class:`PlacementDecoderLayer`:
fairseq's layer classes whose ``forward`` (same signature and return values) hands the
sublayers to the placement's ``sublayers``. The sublayers are fairseq's own modules
(``self_attn``, ``encoder_attn``, ``fc1``/``fc2``), so norm types, inits, QKNorm and the
``residual_connection`` hook (``--residual-scale``) keep working; F(x) is returned without
dropout, the placement applies ``dropout_module`` to the branch.
"""
from typing import Dict, Optional, Sequence, Tuple

import torch
from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerDecoderBase, TransformerEncoderBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import Tensor, nn

from fairseq_normplug.models.placements.base import LAYER_NORM_FACTORY, SUBLAYER_NORMS, Modifier, Placement, Sublayers


class PlacementLayer:
    """What both placement layers share; ``placement`` is set by :meth:`LayerPlan.build_layer`."""

    placement: Placement

    def feed_forward(self, x: Tensor) -> Tensor:
        """fairseq's FFN block without dropout on its output: fc2(act_dropout(act(fc1(x))))."""
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        if getattr(self, "ffn_layernorm", None) is not None:
            x = self.ffn_layernorm(x)
        return self.fc2(x)

    def norm(self, kind: str) -> nn.Module:
        """fairseq's own norm of sublayer ``kind`` (``attn``, ``cross``, ``ffn``)."""
        return getattr(self, SUBLAYER_NORMS[kind])


class PlacementEncoderLayer(PlacementLayer, TransformerEncoderLayerBase):
    """``TransformerEncoderLayerBase.forward`` with the sublayers wired by the placement."""

    def forward(self, x, encoder_padding_mask, attn_mask=None):
        if attn_mask is not None:  # as fairseq does
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4)

        def self_attention(h):
            out = self.self_attn(query=h, key=h, value=h, key_padding_mask=encoder_padding_mask,
                                 need_weights=False, attn_mask=attn_mask)[0]
            attn_ln = getattr(self, "attn_ln", None)  # NormFormer's post-attention norm
            return out if attn_ln is None else attn_ln(out)

        return self.placement.sublayers(self, x, [("attn", self_attention), ("ffn", self.feed_forward)])


class PlacementDecoderLayer(PlacementLayer, TransformerDecoderLayerBase):
    """``TransformerDecoderLayerBase.forward`` (incremental state, cached self-attention keys,
    cross-self-attention, attention weights) with the sublayers wired by the placement."""

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
        x = self.placement.sublayers(self, x, sublayers)
        return x, weights.get("attn"), None


def wrap_layer(layer: nn.Module, cfg) -> nn.Module:
    """fairseq's wrapping of a built layer (``TransformerEncoderBase.build_encoder_layer``,
    fairseq 0.12): activation checkpointing (with CPU offload) when asked for, then FSDP."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    # as fairseq: when checkpointing, FSDP always wraps the checkpointed layer
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class LayerPlan:
    """The resolved ``--norm-placement`` and the modifiers switched on, in registration order."""

    def __init__(self, placement: Placement, modifiers: Sequence[Modifier] = ()):
        self.placement = placement
        self.modifiers = tuple(modifiers)

    @property
    def designs(self):
        return (self.placement, *self.modifiers)

    @property
    def sources(self) -> Tuple[str, ...]:
        """The Python modules that define the placement and the modifiers (a checkpoint records
        the extensions among them, ``extensions.needed_sources``)."""
        return tuple(type(design).__module__ for design in self.designs)

    @property
    def is_stock(self) -> bool:
        """fairseq's own stacks and layers, untouched (``post``, ``pre`` without modifiers)."""
        return self.placement.stock_model and not self.modifiers

    @property
    def sublayer_forward(self) -> bool:
        """Whether the layers run the placement's ``sublayers`` (else fairseq's own forward)."""
        return not self.placement.stock_forward or any(m.sublayer_forward for m in self.modifiers)

    def build_layer(self, cfg, index: int, num_layers: int, decoder: bool, norms=None, **kwargs) -> nn.Module:
        """Layer ``index`` of a stack, built, changed by every design, given its norms by ``norms``
        (the stack's ``norm_factory.StackNorms``; None: as built), then wrapped as fairseq does."""
        if decoder:
            layer_class = PlacementDecoderLayer if self.sublayer_forward else TransformerDecoderLayerBase
        else:
            layer_class = PlacementEncoderLayer if self.sublayer_forward else TransformerEncoderLayerBase
        layer = layer_class(cfg, **kwargs)
        if self.sublayer_forward:
            layer.placement = self.placement
        layer_norms = None if norms is None else norms.layer(index, num_layers)
        layer.__dict__[LAYER_NORM_FACTORY] = layer_norms  # what slot_norm builds from, during the build only
        try:
            for design in self.designs:
                design.build_layer(layer, index, num_layers)
        finally:
            del layer.__dict__[LAYER_NORM_FACTORY]
        if layer_norms is not None:
            layer_norms.fill(layer)  # fairseq's own norms, built inline, and new_norm's placeholders
        return wrap_layer(layer, cfg)

    def build_stack(self, stack: nn.Module) -> None:
        for design in self.designs:
            design.build_stack(stack)

    def finish_model(self, model: nn.Module) -> None:
        for design in self.designs:
            design.finish_model(model)

    def logged_modules(self, model: nn.Module) -> Dict[str, nn.Module]:
        return {name: module for design in self.designs for name, module in design.logged_modules(model).items()}


class PlacedEncoder(TransformerEncoderBase):
    """fairseq's encoder whose ``build_encoder_layer`` builds the layers of ``layer_plan``, their
    norms from ``norm_factory`` (the build's ``NormFactory``; None: as built)."""

    def __init__(self, cfg, dictionary, embed_tokens, layer_plan: LayerPlan, return_fc=False, norm_factory=None):
        self.layer_plan = layer_plan
        self.layer_indices = iter(range(cfg.encoder.layers))  # fairseq builds the layers in order
        norms = None if norm_factory is None else norm_factory.stack(cfg, decoder=False, layer_plan=layer_plan)
        self.stack_norms = norms
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        del self.layer_indices, self.stack_norms
        layer_plan.build_stack(self)
        if norms is not None:
            norms.fill_stack(self)

    def build_encoder_layer(self, cfg):
        return self.layer_plan.build_layer(cfg, next(self.layer_indices), cfg.encoder.layers, decoder=False,
                                           norms=self.stack_norms, return_fc=self.return_fc)


class PlacedDecoder(TransformerDecoderBase):
    """fairseq's decoder whose ``build_decoder_layer`` builds the layers of ``layer_plan`` (None:
    fairseq's own layers, for the decoders that only change the output layer), their norms from
    ``norm_factory`` (None: as built)."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None,
                 layer_plan: Optional[LayerPlan] = None, norm_factory=None):
        self.layer_plan = layer_plan
        self.layer_indices = iter(range(cfg.decoder.layers))
        norms = None if norm_factory is None else norm_factory.stack(cfg, decoder=True, layer_plan=layer_plan)
        self.stack_norms = norms
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)
        del self.layer_indices, self.stack_norms
        if layer_plan is not None:
            layer_plan.build_stack(self)
        if norms is not None:
            norms.fill_stack(self)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        index = next(self.layer_indices)
        if self.layer_plan is None:  # fairseq's own layer, built and wrapped by fairseq: its norms filled after
            layer = super().build_decoder_layer(cfg, no_encoder_attn)
            if self.stack_norms is not None:
                self.stack_norms.layer(index, cfg.decoder.layers).fill(layer)
            return layer
        return self.layer_plan.build_layer(cfg, index, cfg.decoder.layers, decoder=True, norms=self.stack_norms,
                                           no_encoder_attn=no_encoder_attn)
