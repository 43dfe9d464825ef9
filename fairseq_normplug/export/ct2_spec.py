"""A loaded fairseq Transformer (``transformer_normplug`` or stock) as a CTranslate2
``TransformerSpec``, exactly, or a one-line refusal (:class:`~fairseq_normplug.errors.NormplugError`).

What is written is decided by what the model's modules *are*, never by flag names:

* the layers must be fairseq's own layer classes, PostNorm or PreNorm (a ``--norm-placement``
  or modifier that rewires them gives its stacks a ``layer_plan``: refused, naming the design
  as the placement registry describes it);
* every norm module must be of a class in :data:`NORM_WRITERS` (torch's LayerNorm, LayerNorm1p,
  RMSNorm, ScaleNorm); any other registered norm type (DyT and the other pointwise norms, ...)
  is refused, named by the norm registry;
* the output layer must be one of :data:`OUTPUT_LAYERS` (fairseq's, FixNorm's, the target
  vocabulary mask's);
* every parameter of the model must have been written somewhere; one that was not (a design
  adding weights CTranslate2 has no place for) is refused by name.

Folds, all exact (docs/deployment.md):

* ScaleNorm g x / max(||x||, eps) = (g / sqrt(d)) x / rms(x) (Nguyen & Salazar 2019, eq. 5):
  an RMSNorm whose gain is g / sqrt(d) in every channel and whose epsilon is eps^2 / d
  (sqrt(mean(x^2) + eps^2/d) = sqrt(||x||^2 + eps^2) / sqrt(d): the two differ by a relative
  eps^2 / (2 ||x||^2), below float32 rounding once ||x|| > 3e3 eps, 0.03 at the default eps;
  the hidden states a norm sees are orders of magnitude larger);
* RMSNorm and LayerNorm with ``--zero-centered-gamma``: the applied gain 1 + gamma;
* FixNorm (Nguyen & Chiang 2018; Tears eq. 6): the l2-normalised rows are constant at
  inference, written as the embedding matrix (and as the tied output matrix);
* ``--output-bias``: the output bias; ``--target-vocab-mask`` and padding: a bias of -1e9 on
  the masked types and on padding (fairseq's search never emits padding), so after the
  softmax they have probability 0, as in the model.
"""
import argparse
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from ctranslate2.converters import fairseq as ct2_fairseq
from ctranslate2.specs import transformer_spec
from fairseq.models.transformer import (TransformerDecoder, TransformerDecoderBase, TransformerEncoder,
                                        TransformerEncoderBase)
from fairseq.modules import MultiheadAttention
from fairseq.modules.transformer_layer import (TransformerDecoderLayer, TransformerDecoderLayerBase,
                                               TransformerEncoderLayer, TransformerEncoderLayerBase)
from omegaconf import OmegaConf
from torch import nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.models.transformer_normplug import FixNormTransformerDecoder, TargetVocabMaskTransformerDecoder
from fairseq_normplug.modules.fixnorm_embedding import FixNormEmbedding
from fairseq_normplug.modules.layer_norm_1p import LayerNorm1p
from fairseq_normplug.modules.norm_base import effective_gain
from fairseq_normplug.modules.norm_registry import NORM_TYPES, norm_type_of
from fairseq_normplug.modules.rms_norm import RMSNorm
from fairseq_normplug.modules.scale_norm import ScaleNorm
from fairseq_normplug.modules.target_vocab_mask import MASKED_LOGIT

#: the layer classes whose forward CTranslate2's Transformer layers compute (fairseq's own)
ENCODER_LAYERS = (TransformerEncoderLayerBase, TransformerEncoderLayer)
DECODER_LAYERS = (TransformerDecoderLayerBase, TransformerDecoderLayer)
ENCODERS = (TransformerEncoderBase, TransformerEncoder)
#: the logit given to padding and to the types ``--target-vocab-mask`` masks (the authors' -1e9)
SUPPRESSED_LOGIT = MASKED_LOGIT
#: fairseq options that change the forward without adding a parameter, which CTranslate2 cannot express
UNEXPRESSED_OPTIONS = {
    "cross_self_attention": "CTranslate2's decoder self-attention does not attend to the encoder output",
}


def refuse(message: str) -> None:
    raise NormplugError(f"cannot export to CTranslate2: {message}")


class Norm:
    """One norm as CTranslate2 writes it: ``rms`` (RMSNorm, no beta) or LayerNorm, its gain,
    bias (LayerNorm only) and epsilon."""

    def __init__(self, rms: bool, gamma: torch.Tensor, beta: Optional[torch.Tensor], eps: float):
        self.rms, self.gamma, self.beta, self.eps = rms, gamma, beta, eps


def layer_norm(module: nn.LayerNorm) -> Norm:
    """torch's LayerNorm (fairseq's on CPU) or LayerNorm1p: gamma (1 + gamma when zero-centred), beta, eps."""
    if not module.elementwise_affine or module.bias is None:
        refuse(f"a LayerNorm without gain or bias ({module}): CTranslate2's LayerNorm has both")
    return Norm(False, effective_gain(module), module.bias, module.eps)


def rms_norm(module: RMSNorm) -> Norm:
    """RMSNorm: its applied gain (1 + gamma when zero-centred) and eps, as they are."""
    return Norm(True, effective_gain(module), None, module.eps)


def scale_norm(module: ScaleNorm) -> Norm:
    """ScaleNorm folded into an RMSNorm: gain g / sqrt(d) everywhere, eps^2 / d (module docstring)."""
    d = module.dim
    gain = module.g.detach().float() / d ** 0.5
    return Norm(True, gain.expand(d).clone(), None, module.eps ** 2 / d)


#: {norm module class: how CTranslate2 writes it}; exact classes (a subclass computes something else)
NORM_WRITERS: Dict[type, Callable[[nn.Module], Norm]] = {
    nn.LayerNorm: layer_norm, LayerNorm1p: layer_norm, RMSNorm: rms_norm, ScaleNorm: scale_norm,
}


def exportable_norm_types() -> str:
    """The registered norm types whose modules :data:`NORM_WRITERS` writes."""
    return ", ".join(name for name, norm in NORM_TYPES.items()
                     if ({norm.module, *getattr(norm.module, "module_classes", ())} & set(NORM_WRITERS)))


def read_norm(module: nn.Module, where: str) -> Norm:
    """``module`` as CTranslate2 writes it, or a refusal naming its registered norm type."""
    writer = NORM_WRITERS.get(type(module))
    if writer is None:
        name = norm_type_of(module)
        refuse(f"{where} is a --norm-type {name} norm ({type(module).__name__}); CTranslate2 normalises "
               f"with LayerNorm or RMSNorm only, so it exports {exportable_norm_types()} (ScaleNorm folded "
               f"into RMSNorm), never an approximation of {name}")
    return writer(module)


class SpecWriter:
    """Writes one model into a ``TransformerSpec`` and records which parameters it used."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.used: Set[int] = set()
        self.names = {id(module): name for name, module in model.named_modules()}

    def use(self, *tensors) -> None:
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self.used.add(id(tensor))

    def where(self, module: nn.Module) -> str:
        return self.names.get(id(module), type(module).__name__)

    def module(self, module: nn.Module, classes: tuple, what: str) -> nn.Module:
        """``module``, whose class must be exactly one of ``classes``, else a refusal naming it."""
        if type(module) not in classes:
            residual = getattr(getattr(module, "residual_scale", None), "kind", None)  # --residual-scale's layers
            design = f" (--residual-scale {residual}: CTranslate2 adds residuals as x + F(x))" if residual else ""
            refuse(f"{self.where(module)} is a {type(module).__name__}{design}; CTranslate2's {what} is "
                   f"{' or '.join(sorted({c.__name__ for c in classes}))}")
        return module

    def linear(self, spec, module: nn.Linear) -> None:
        self.module(module, (nn.Linear,), "linear layer")
        ct2_fairseq.set_linear(spec, module)
        self.use(module.weight, module.bias)

    def norm(self, spec, module: nn.Module) -> None:
        norm = read_norm(module, self.where(module))
        self.use(*module.parameters(recurse=False))
        spec.gamma = norm.gamma.detach().float().numpy()
        if not norm.rms:
            spec.beta = norm.beta.detach().float().numpy()

    def attention(self, spec, module: nn.Module, self_attention: bool) -> None:
        self.module(module, (MultiheadAttention,), "attention")
        for projection in (module.q_proj, module.k_proj, module.v_proj, module.out_proj):
            self.module(projection, (nn.Linear,), "attention projection")
        if module.scaling != module.head_dim ** -0.5:
            refuse(f"{self.where(module)} scales q.k by {module.scaling:g}, not 1/sqrt(d_head) (as --qknorm does); "
                   f"CTranslate2 computes softmax(q k^T / sqrt(d_head)) v")
        if module.bias_k is not None or module.add_zero_attn:
            refuse(f"{self.where(module)} has key/value biases or zero attention (--add-bias-kv, --add-zero-attn)")
        for projection in (module.q_proj, module.k_proj, module.v_proj, module.out_proj):
            self.use(projection.weight, projection.bias)
        ct2_fairseq.set_multi_head_attention(spec, module, self_attention=self_attention)

    def ffn(self, spec, layer: nn.Module) -> None:
        self.norm(spec.layer_norm, layer.final_layer_norm)
        self.linear(spec.linear_0, layer.fc1)
        self.linear(spec.linear_1, layer.fc2)

    def embeddings(self, spec, stack: nn.Module) -> None:
        """Token embeddings (FixNorm: the normalised rows), their scale and the positions."""
        tokens = stack.embed_tokens
        self.module(tokens, (nn.Embedding, FixNormEmbedding), "embedding")
        weight = tokens.normalized_weight() if isinstance(tokens, FixNormEmbedding) else tokens.weight
        target = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
        target.weight = weight.detach().float().numpy()
        self.use(tokens.weight)
        spec.scale_embeddings = float(stack.embed_scale)
        self.use(stack.embed_scale)
        if stack.embed_positions is None:
            refuse(f"{self.where(stack)} has no positional embeddings")
        ct2_fairseq.set_position_encodings(spec.position_encodings, stack.embed_positions)
        self.use(*stack.embed_positions.parameters())
        if stack.layernorm_embedding is not None:
            self.norm(spec.layernorm_embedding, stack.layernorm_embedding)
        if stack.layer_norm is not None:
            if not spec.pre_norm:
                refuse(f"{self.where(stack)} ends with a final norm after PostNorm layers; CTranslate2 has "
                       f"final norms for PreNorm stacks only")
            self.norm(spec.layer_norm, stack.layer_norm)

    def encoder(self, spec, encoder: nn.Module) -> None:
        self.module(encoder, ENCODERS, "encoder")
        self.embeddings(spec, encoder)
        for layer_spec, layer in zip(spec.layer, encoder.layers):
            self.module(layer, ENCODER_LAYERS, "encoder layer")
            self.attention(layer_spec.self_attention, layer.self_attn, self_attention=True)
            self.norm(layer_spec.self_attention.layer_norm, layer.self_attn_layer_norm)
            self.ffn(layer_spec.ffn, layer)

    def decoder(self, spec, decoder: nn.Module) -> None:
        self.module(decoder, tuple(OUTPUT_LAYERS), "decoder")
        self.embeddings(spec, decoder)
        for layer_spec, layer in zip(spec.layer, decoder.layers):
            self.module(layer, DECODER_LAYERS, "decoder layer")
            self.attention(layer_spec.self_attention, layer.self_attn, self_attention=True)
            self.norm(layer_spec.self_attention.layer_norm, layer.self_attn_layer_norm)
            if layer.encoder_attn is None:
                refuse(f"{self.where(layer)} has no cross-attention (--no-cross-attention)")
            self.attention(layer_spec.attention, layer.encoder_attn, self_attention=False)
            self.norm(layer_spec.attention.layer_norm, layer.encoder_attn_layer_norm)
            self.ffn(layer_spec.ffn, layer)
        weight, bias = OUTPUT_LAYERS[type(decoder)](decoder)
        bias = torch.zeros(weight.size(0)) if bias is None else bias.detach().float().clone()
        self.use(decoder.output_projection.weight, decoder.output_projection.bias)
        bias[decoder.padding_idx] = SUPPRESSED_LOGIT
        mask = getattr(decoder, "target_vocab_mask", None)
        if mask is not None:
            bias[~mask.allowed] = SUPPRESSED_LOGIT
        spec.projection.weight = weight.detach().float().numpy()
        spec.projection.bias = bias.numpy()

    def check_every_parameter_written(self) -> None:
        unused = [name for name, p in self.model.named_parameters() if id(p) not in self.used]
        if unused:
            refuse(f"CTranslate2's Transformer has no place for {', '.join(unused[:3])}"
                   f"{f' (and {len(unused) - 3} more)' if len(unused) > 3 else ''}")


def norm_config(norms: List[Tuple[str, Norm]]) -> Tuple[bool, float]:
    """(RMSNorm everywhere?, the one epsilon) of ``norms`` ((where, norm) pairs): CTranslate2 has
    one norm kind and one epsilon in a model."""
    kinds = {norm.rms for _, norm in norms}
    if len(kinds) > 1:
        rms = next(name for name, norm in norms if norm.rms)
        plain = next(name for name, norm in norms if not norm.rms)
        refuse(f"{rms} is an RMSNorm and {plain} a LayerNorm; CTranslate2 uses one norm kind in a model")
    epsilons = sorted({norm.eps for _, norm in norms})
    if len(epsilons) > 1:
        refuse(f"norms with different epsilons {epsilons}; CTranslate2 uses one in a model")
    return kinds.pop(), epsilons[0]


def plain_output_layer(decoder) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if decoder.adaptive_softmax is not None:
        refuse("an adaptive softmax output layer (--adaptive-softmax-cutoff)")
    projection = decoder.output_projection
    if type(projection) is not nn.Linear:
        refuse(f"the output projection is a {type(projection).__name__}, not a linear layer")
    return projection.weight, projection.bias


def fixnorm_output_layer(decoder) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FixNorm's tied output layer (Tears eq. 6): the normalised embedding rows, the output bias."""
    return decoder.embed_tokens.normalized_weight(), decoder.output_projection.bias


#: {decoder class: (weight, bias) its output layer computes logits with}
OUTPUT_LAYERS: Dict[type, Callable] = {
    TransformerDecoderBase: plain_output_layer, TransformerDecoder: plain_output_layer,
    TargetVocabMaskTransformerDecoder: plain_output_layer, FixNormTransformerDecoder: fixnorm_output_layer,
}


def refuse_layer_plans(model: nn.Module) -> None:
    """A placement or modifier that rewires fairseq's layers (the plugin's ``layer_plan``):
    refused, named as the placement registry describes it."""
    for stack in (model.encoder, model.decoder):
        plan = getattr(stack, "layer_plan", None)
        if plan is not None:
            designs = " with ".join(design.describe() for design in plan.designs)
            refuse(f"{designs}: CTranslate2's Transformer layers are PostNorm or PreNorm only "
                   f"(x + F(LN(x)) or LN(x + F(x)) in every sublayer), it has no spec for this design")


def check_with_ctranslate2(model_args) -> None:
    """CTranslate2's own fairseq checks (activation, positional embeddings, one PreNorm/PostNorm
    for both stacks, one head count), on a copy of the checkpoint's model arguments as a stock
    ``transformer``; their reasons as one line."""
    values = OmegaConf.to_container(model_args, resolve=True) if OmegaConf.is_config(model_args) else vars(model_args)
    for option, reason in UNEXPRESSED_OPTIONS.items():
        if values.get(option):
            refuse(f"--{option.replace('_', '-')}: {reason}")
    try:
        ct2_fairseq._get_model_spec(argparse.Namespace(**{**values, "arch": "transformer"}))
    except ValueError as error:
        reasons = [line[2:] for line in str(error).splitlines() if line.startswith("- ")] or [str(error)]
        refuse("; ".join(reasons))


def _value(model_args, name: str, default):
    """``model_args.name``, or ``default`` where it is missing or None (as CTranslate2's converter reads it)."""
    value = getattr(model_args, name, None)
    return default if value is None else value


def build_spec(model: nn.Module, model_args, source_dictionary, target_dictionary) -> transformer_spec.TransformerSpec:
    """The ``TransformerSpec`` of ``model`` (eval mode, CPU), with its vocabularies and config
    (fairseq's: decoding starts with </s>, the source ends with </s>), or a one-line refusal."""
    check_with_ctranslate2(model_args)
    refuse_layer_plans(model)
    encoder, decoder = model.encoder, model.decoder
    activation = ct2_fairseq._SUPPORTED_ACTIVATIONS[getattr(model_args, "activation_fn", None) or "relu"]
    pre_norm = bool(encoder.layers[0].normalize_before)
    # the norm kind and epsilon are model-wide in CTranslate2: read them off the norms first
    rms, eps = norm_config([(name, read_norm(module, name)) for name, module in named_norms(model).items()])
    common = dict(pre_norm=pre_norm, activation=activation, rms_norm=rms)
    encoder_spec = transformer_spec.TransformerEncoderSpec(
        len(encoder.layers), encoder.layers[0].self_attn.num_heads, no_final_norm=encoder.layer_norm is None,
        layernorm_embedding=encoder.layernorm_embedding is not None, **common)
    decoder_spec = transformer_spec.TransformerDecoderSpec(
        len(decoder.layers), decoder.layers[0].self_attn.num_heads, no_final_norm=decoder.layer_norm is None,
        layernorm_embedding=decoder.layernorm_embedding is not None,
        alignment_layer=_value(model_args, "alignment_layer", -1),
        alignment_heads=_value(model_args, "alignment_heads", 0), **common)
    spec = transformer_spec.TransformerSpec(encoder_spec, decoder_spec)
    writer = SpecWriter(model)
    with torch.no_grad():
        writer.encoder(spec.encoder, encoder)
        writer.decoder(spec.decoder, decoder)
    writer.check_every_parameter_written()
    spec.config.layer_norm_epsilon = float(eps)
    spec.register_source_vocabulary(ct2_fairseq._get_vocab(source_dictionary))
    spec.register_target_vocabulary(ct2_fairseq._get_vocab(target_dictionary))
    spec.config.decoder_start_token = spec.config.eos_token
    spec.config.add_source_eos = True
    return spec
