"""``transformer_normplug``: fairseq's Transformer with every normalization choice of
"Transformers without Tears" and "Transformers without Normalization" behind flags.

It subclasses the stock ``transformer`` model, so every stock flag keeps working, and with
every plugin flag off it *is* the stock model (same modules, parameter names, init and
outputs; a stock checkpoint loads). The plugin only acts through small build hooks:
``build_embedding`` (FixNorm rows), ``build_encoder`` / ``build_decoder`` (the layer plan and the
norm factory, FixNorm's output layer, the target vocabulary mask), and, after the stock build,
re-initialisation, the output bias, then the later designs (docs/beyond.md): DeepNorm's
init, residual scaling through each layer's ``residual_connection`` hook, QKNorm's q/k
projections and the learnable embedding scale; last, a check that no norm slot still holds
a placeholder (``refuse_placeholders``, models/norm_placement.py).

The norms are built, not patched: :class:`~fairseq_normplug.models.norm_factory.NormFactory`, made
once per build from the resolved configuration, goes down the build hooks with the layer plan,
and every norm slot gets its module where its layer or stack is built (models/norm_factory.py
says where: a design's slots through ``slot_norm``, fairseq's inline-built stock attributes
filled by attribute as their layer or stack is built, the only attribute-path replacement).

``--norm-placement`` and its modifiers are built where fairseq builds layers: ``build_encoder``
/ ``build_decoder`` give the stacks the resolved :class:`LayerPlan`, and the stacks'
``build_encoder_layer`` / ``build_decoder_layer`` hooks build each layer from it
(``models/placements/layers.py``). The plan is an argument: :meth:`TransformerNormplugModel.
build_fairseq_model` is fairseq's own ``build_model`` (the two levels, legacy and base, line for
line; a test fails when fairseq's code of them changes) whose calls of ``build_encoder`` /
``build_decoder`` pass the plan and the norm factory along. No build state lives outside the call.

``build_model`` resolves the flags once (``models/resolved_config.py``: :func:`resolve`) and keeps
the frozen result on the model as ``model.normplug_config``, which readers of a built or loaded
model ask instead of the raw flags.
"""
import logging
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from fairseq.models import register_model
from fairseq.models.transformer import TransformerConfig, TransformerModel
from fairseq.models.transformer.transformer_config import (
    DEFAULT_MAX_SOURCE_POSITIONS, DEFAULT_MAX_TARGET_POSITIONS, DEFAULT_MIN_PARAMS_TO_WRAP)
from fairseq.models.transformer.transformer_legacy import base_architecture
from omegaconf import OmegaConf

from fairseq_normplug.errors import NormplugError, exit_with_one_line, in_hydra_job
from fairseq_normplug.extensions import load_command_line_extensions
from fairseq_normplug.fairseq_parsing import one_line_errors, parse_in_progress
from fairseq_normplug.models.args_writer import write_resolved
from fairseq_normplug.models.norm_parameters import norm_parameter_names
from fairseq_normplug.models.norm_factory import NormFactory
from fairseq_normplug.models.norm_placement import named_norms, refuse_placeholders
from fairseq_normplug.models.normplug_args import add_normplug_args
from fairseq_normplug.models.normplug_config import check_model_setting_names, resolved_config
from fairseq_normplug.models.placements.layers import LayerPlan, PlacedDecoder, PlacedEncoder
from fairseq_normplug.models.resolved_config import resolve
from fairseq_normplug.modules.auto_init import AutoScaleInit
from fairseq_normplug.modules.fixnorm_embedding import FixNormEmbedding
from fairseq_normplug.modules.embed_scale import make_embed_scale_learnable
from fairseq_normplug.modules.norm_stats import NormStatsRecorder
from fairseq_normplug.modules.qknorm import install_qknorm, resolve_g0
from fairseq_normplug.modules.residual_scale import deepnorm_constants, install_residual_scale
from fairseq_normplug.modules.target_vocab_mask import TargetVocabMask, build_allowed_types
from fairseq_normplug.modules.weight_init import apply_deepnorm_init, apply_model_init
from fairseq_normplug.optim.norm_weight_decay import mark_norm_parameters

#: the padding logit is set this far below the row's smallest logit: its probability is
#: ~e^-30 of the least likely word, so pad is never predicted, while label smoothing
#: (which sums log-probabilities over the whole vocabulary) stays finite
PAD_LOGIT_MARGIN = 30.0
#: fairseq's functions that :meth:`TransformerNormplugModel.build_fairseq_model` replicates: per
#: fairseq release, {function: fairseq_patches.source_digest of its source} as read when the replica
#: was written (tests/test_model_build.py fails when fairseq's code differs: compare, then record)
REPLICATED_FAIRSEQ_BUILD: Dict[str, Dict[str, str]] = {
    "0.12.2": {  # read from fairseq's v0.12.2 tag: no --merge-src-tgt-embed branch in the base level
        "fairseq.models.transformer.transformer_legacy.TransformerModel.build_model": "7631bf5a7b0f0ec6",
        "fairseq.models.transformer.transformer_base.TransformerModelBase.build_model": "652bc8362333172c",
    },
    "0.12.3.1": {
        "fairseq.models.transformer.transformer_legacy.TransformerModel.build_model": "7631bf5a7b0f0ec6",
        "fairseq.models.transformer.transformer_base.TransformerModelBase.build_model": "7476f471491104fd",
    },
}

logger = logging.getLogger(__name__)


def mask_padding_logit(logits: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """Set the padding column of freshly computed ``logits`` (in place: one pass for the row
    minimum, none over the whole tensor) to ``PAD_LOGIT_MARGIN`` below the smallest logit of
    the other words (the pad column itself is left out), clamped to the dtype's range so the
    floor stays finite in fp16; no gradient flows through that column."""
    logits[..., padding_idx] = float("inf")
    floor = logits.detach().amin(dim=-1) - PAD_LOGIT_MARGIN
    logits[..., padding_idx] = floor.clamp(min=torch.finfo(logits.dtype).min)
    return logits


def apply_target_vocab_mask(decoder, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` through the decoder's ``--target-vocab-mask``, if it has one."""
    mask = getattr(decoder, "target_vocab_mask", None)
    return logits if mask is None else mask(logits)


class FixNormTransformerDecoder(PlacedDecoder):
    """Decoder whose tied output layer uses the l2-normalised embedding rows (eq. 6):
    logits are cosines scaled by the norm of the final hidden state (plus the output bias
    with ``--output-bias``, then the target vocabulary mask with ``--target-vocab-mask``)."""

    def output_layer(self, features):
        # as one (rows, d) x (d, V) product: torch's matmul does not fold a 3-D input with
        # decoding's strides into one GEMM when the weight needs no gradient (the cached
        # matrix), and runs a GEMV per row instead, ~10x slower at a 32k vocabulary
        rows = features.reshape(-1, features.size(-1))
        logits = F.linear(rows, self.embed_tokens.normalized_weight(), self.output_projection.bias)
        logits = logits.view(*features.shape[:-1], logits.size(-1))
        return apply_target_vocab_mask(self, mask_padding_logit(logits, self.padding_idx))


class TargetVocabMaskTransformerDecoder(PlacedDecoder):
    """fairseq's decoder whose logits go through ``target_vocab_mask`` (``--target-vocab-mask``
    without FixNorm): same modules and parameters as the stock decoder, plus the mask buffer."""

    def output_layer(self, features):
        return apply_target_vocab_mask(self, super().output_layer(features))


def add_output_bias(decoder) -> None:
    """``--output-bias``: a learnable bias per type on the output layer, initialised to 0
    (the authors' ``out_bias``), as ``decoder.output_projection.bias``."""
    projection = decoder.output_projection
    projection.bias = nn.Parameter(projection.weight.new_zeros(projection.out_features))


@register_model("transformer_normplug")
class TransformerNormplugModel(TransformerModel):
    """Transformer with pluggable residual placement, norm type, FixNorm and init.

    Flags: ``--norm-placement`` (shorthands ``--prenorm``/``--postnorm``; ``--mix-ln-ratio``,
    ``--layernorm-scaling``), ``--norm-type`` (a registered norm type, shorthands
    ``--scalenorm``, ``--rmsnorm``, ``--dyt``), ``--fixnorm``, ``--smallinit`` /
    ``--weight-init``, the authors' output layer ``--target-vocab-mask`` and ``--output-bias``,
    and the later designs ``--qknorm``, ``--residual-scale``, ``--embed-scale``
    (docs/beyond.md); see ``fairseq-train --arch transformer_normplug --help``.
    """

    @classmethod
    def add_args(cls, parser):
        parse = parse_in_progress()
        one_line_errors(parse.parser)  # a misspelt or bad flag: one line, the nearest flags named
        load_command_line_extensions(parse.argv)  # an extension's norms and flags, from input_args too
        super().add_args(parser)
        add_normplug_args(parser)

    @classmethod
    def build_model(cls, args, task):
        try:
            if OmegaConf.is_config(args):  # a hydra cfg.model, through any door (plain fairseq-hydra-train too)
                check_model_setting_names(args, args._name)
            return cls._build_model(args, task)
        except NormplugError as error:
            if in_hydra_job():  # hydra would print the error with a stack trace and exit 1
                exit_with_one_line(error)
            raise

    @classmethod
    def _build_model(cls, args, task):
        config = resolve(args)  # kept on the model: what its readers ask (models/resolved_config.py)
        settings = config.settings
        if getattr(args, "share_all_embeddings", False) and task.source_dictionary != task.target_dictionary:
            raise NormplugError(
                "--share-all-embeddings needs a joined dictionary (fairseq-preprocess "
                "--joined-dictionary); with separate dictionaries pass "
                "--share-decoder-input-output-embed instead")
        beyond, output = settings.beyond, settings.output
        if beyond.qknorm and getattr(args, "qknorm_g0", None) is None:  # from the data, once: recorded
            write_resolved(args, {"qknorm_g0": resolve_g0(args, task)})
        g0 = resolve_g0(args, task) if beyond.qknorm else None  # before the (slow) build
        allowed = build_allowed_types(args, task) if output.target_vocab_mask else None
        layer_plan = settings.layer_plan
        # every build hook reads the resolved flags from this one TransformerNormplugConfig (a
        # DictConfig from hydra would lose the plugin's keys in TransformerConfig.from_namespace)
        norm_factory = NormFactory(args, config)  # every norm slot's module, where its layer is built
        model = cls.build_fairseq_model(resolved_config(args), task,
                                        layer_plan=None if layer_plan.is_stock else layer_plan,
                                        norm_factory=norm_factory)
        norm_factory.check_built_model(model)  # an unused --norm-types-per-layer entry: one line
        apply_model_init(model, settings.weight_init)
        if output.output_bias:
            add_output_bias(model.decoder)
        if output.target_vocab_mask:
            model.decoder.target_vocab_mask = TargetVocabMask(len(task.target_dictionary), allowed)
        if beyond.residual_scale == "deepnorm":
            constants = deepnorm_constants(len(model.encoder.layers), len(model.decoder.layers))
            apply_deepnorm_init(model, constants["encoder_beta"], constants["decoder_beta"])
        install_residual_scale(model, beyond.residual_scale)
        # b2t: the authors' rescaled init; --layernorm-scaling's hooks; --gpas wraps the residual scale
        layer_plan.finish_model(model)
        if beyond.qknorm:
            install_qknorm(model, g0)
        if beyond.embed_scale == "learnable":
            make_embed_scale_learnable(model)
        if beyond.norm_weight_decay is not None:
            mark_norm_parameters(model, norm_parameter_names(model), beyond.norm_weight_decay)
        model.norm_stats = NormStatsRecorder({**named_norms(model), **layer_plan.logged_modules(model)},
                                             settings.norm_stats_interval)
        model.auto_scale_init = AutoScaleInit(named_norms(model), {"enc": model.encoder, "dec": model.decoder})
        model.normplug_config = config
        refuse_placeholders(model, norm_factory)  # a slot filled after its layer was built: one line
        return model

    @classmethod
    def build_fairseq_model(cls, config, task, layer_plan: Optional[LayerPlan],
                            norm_factory: Optional[NormFactory] = None):
        """fairseq's ``TransformerModel.build_model`` (transformer_legacy.py) followed by the
        ``TransformerModelBase.build_model`` it calls (transformer_base.py), replicated line for
        line (fairseq's sources recorded in :data:`REPLICATED_FAIRSEQ_BUILD`), except that
        ``build_encoder`` / ``build_decoder`` also get ``layer_plan`` (None: fairseq's own stacks) and
        ``norm_factory`` (None: every norm as fairseq builds it).
        The per-layer checkpoint-activations / offload and FSDP wrapping stay in the stacks'
        ``build_*_layer`` (fairseq's, or ``LayerPlan.build_layer``), as in fairseq.

        ``config`` is the build's TransformerNormplugConfig (``resolved_config(args)``, a copy): the
        writes below are fairseq's own, to that copy, as when fairseq's build_model ran them; one
        name for both levels, since fairseq's ``from_namespace`` returns that object itself."""
        # -- fairseq TransformerModel.build_model (the legacy, argparse-namespace level)
        base_architecture(config)  # make sure all arguments are present in older models
        if config.encoder_layers_to_keep:
            config.encoder_layers = len(config.encoder_layers_to_keep.split(","))
        if config.decoder_layers_to_keep:
            config.decoder_layers = len(config.decoder_layers_to_keep.split(","))
        if getattr(config, "max_source_positions", None) is None:
            config.max_source_positions = DEFAULT_MAX_SOURCE_POSITIONS
        if getattr(config, "max_target_positions", None) is None:
            config.max_target_positions = DEFAULT_MAX_TARGET_POSITIONS
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        if config.share_all_embeddings:
            if src_dict != tgt_dict:
                raise ValueError("--share-all-embeddings requires a joined dictionary")
            if config.encoder_embed_dim != config.decoder_embed_dim:
                raise ValueError(
                    "--share-all-embeddings requires --encoder-embed-dim to match --decoder-embed-dim")
            if config.decoder_embed_path and (config.decoder_embed_path != config.encoder_embed_path):
                raise ValueError("--share-all-embeddings not compatible with --decoder-embed-path")
            config.share_decoder_input_output_embed = True
        if getattr(config, "offload_activations", False):
            config.checkpoint_activations = True  # offloading implies checkpointing
        if not config.share_all_embeddings:
            config.min_params_to_wrap = getattr(config, "min_params_to_wrap", DEFAULT_MIN_PARAMS_TO_WRAP)
        config = TransformerConfig.from_namespace(config)  # a TransformerNormplugConfig: returned itself

        # -- fairseq TransformerModelBase.build_model (the TransformerConfig level)
        config.decoder.input_dim = int(config.decoder.input_dim)  # fairseq's T96535332 (OmegaConf and argparse)
        config.decoder.output_dim = int(config.decoder.output_dim)
        if config.encoder.layers_to_keep:
            config.encoder.layers = len(config.encoder.layers_to_keep.split(","))
        if config.decoder.layers_to_keep:
            config.decoder.layers = len(config.decoder.layers_to_keep.split(","))
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        if config.share_all_embeddings:
            if src_dict != tgt_dict:
                raise ValueError("--share-all-embeddings requires a joined dictionary")
            if config.encoder.embed_dim != config.decoder.embed_dim:
                raise ValueError(
                    "--share-all-embeddings requires --encoder-embed-dim to match --decoder-embed-dim")
            if config.decoder.embed_path and (config.decoder.embed_path != config.encoder.embed_path):
                raise ValueError("--share-all-embeddings not compatible with --decoder-embed-path")
            encoder_embed_tokens = cls.build_embedding(config, src_dict, config.encoder.embed_dim,
                                                       config.encoder.embed_path)
            decoder_embed_tokens = encoder_embed_tokens
            config.share_decoder_input_output_embed = True
        elif getattr(config, "merge_src_tgt_embed", False):  # fairseq 0.12.3's; 0.12.2 has no such field
            logger.info(f"source dict size: {len(src_dict)}")
            logger.info(f"target dict size: {len(tgt_dict)}")
            src_dict.update(tgt_dict)
            task.src_dict = src_dict
            task.tgt_dict = src_dict
            logger.info(f"merged dict size: {len(src_dict)}")
            encoder_embed_tokens = cls.build_embedding(config, src_dict, config.encoder.embed_dim)
            decoder_embed_tokens = encoder_embed_tokens
            config.share_decoder_input_output_embed = True
        else:
            encoder_embed_tokens = cls.build_embedding(config, src_dict, config.encoder.embed_dim,
                                                       config.encoder.embed_path)
            decoder_embed_tokens = cls.build_embedding(config, tgt_dict, config.decoder.embed_dim,
                                                       config.decoder.embed_path)
        if config.offload_activations:
            config.checkpoint_activations = True  # offloading implies checkpointing
        # the plugin's one change: the layer plan and the norm factory passed to the two hooks
        encoder = cls.build_encoder(config, src_dict, encoder_embed_tokens, layer_plan=layer_plan,
                                    norm_factory=norm_factory)
        decoder = cls.build_decoder(config, tgt_dict, decoder_embed_tokens, layer_plan=layer_plan,
                                    norm_factory=norm_factory)
        return cls(config, encoder, decoder)

    def load_state_dict(self, state_dict, *args, **kwargs):
        # loaded values (resume, generate) are already initialised: no ``auto`` init
        auto_init = getattr(self, "auto_scale_init", None)
        if auto_init is not None:
            auto_init.cancel()
        return super().load_state_dict(state_dict, *args, **kwargs)

    @classmethod
    def build_embedding(cls, cfg, dictionary, embed_dim, path=None):
        cfg = resolved_config(cfg)  # the object build_model passes (unchanged), or a caller's args
        if not cfg.fixnorm:
            return super().build_embedding(cfg, dictionary, embed_dim, path)
        if path:
            raise NormplugError(f"--fixnorm cannot start from pretrained embeddings ({path})")
        return FixNormEmbedding(len(dictionary), embed_dim, dictionary.pad())

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens, layer_plan: Optional[LayerPlan] = None,
                      norm_factory: Optional[NormFactory] = None):
        """fairseq's encoder, or with a ``layer_plan`` the stack that builds its layers; its norms
        from ``norm_factory`` (fairseq's own stack: its stock norm attributes filled once it is built)."""
        if layer_plan is None:
            encoder = super().build_encoder(cfg, src_dict, embed_tokens)
            if norm_factory is not None:
                norm_factory.fill_fairseq_stack(encoder, resolved_config(cfg), decoder=False)
            return encoder
        return PlacedEncoder(resolved_config(cfg), src_dict, embed_tokens, layer_plan, norm_factory=norm_factory)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens, layer_plan: Optional[LayerPlan] = None,
                      norm_factory: Optional[NormFactory] = None):
        """fairseq's decoder, or the one whose output layer FixNorm / the target vocabulary mask
        changes, or with a ``layer_plan`` the stack that builds its layers; its norms from
        ``norm_factory`` (fairseq's own stack: its stock norm attributes filled once it is built)."""
        cfg = resolved_config(cfg)
        if cfg.fixnorm:
            decoder_class = FixNormTransformerDecoder
        elif cfg.target_vocab_mask:
            decoder_class = TargetVocabMaskTransformerDecoder
        elif layer_plan is not None:
            decoder_class = PlacedDecoder
        else:
            decoder = super().build_decoder(cfg, tgt_dict, embed_tokens)
            if norm_factory is not None:
                norm_factory.fill_fairseq_stack(decoder, cfg, decoder=True)
            return decoder
        return decoder_class(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention,
                             layer_plan=layer_plan, norm_factory=norm_factory)

    def set_num_updates(self, num_updates):
        super().set_num_updates(num_updates)
        recorder = getattr(self, "norm_stats", None)
        if recorder is not None:
            recorder.set_num_updates(num_updates)

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".", **kwargs):
        """fairseq's hub loader; from a checkpoint folder the project's training wrote (the
        dictionaries and subword model beside the checkpoints), the subword model and Moses
        tokenizer by default, so ``translate`` takes raw text (fairseq_normplug/hub.py)."""
        from fairseq_normplug.hub import hub_defaults

        return super().from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path,
                                       **hub_defaults(model_name_or_path, kwargs))
