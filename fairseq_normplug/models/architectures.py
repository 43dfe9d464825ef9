"""Named presets of ``transformer_normplug`` (``--arch NAME``). Presets fill in fairseq's
defaults only (sizes, dropout and embedding tying), as fairseq's own architectures do;
normalization choices always come from the flags, and what the plugin itself must write into
``args`` is written by models/args_writer.py."""
from fairseq.models import register_model_architecture
from fairseq.models.transformer.transformer_legacy import base_architecture

from fairseq_normplug.models.args_writer import bf16_without_tpu
from fairseq_normplug.models.normplug_args import resolve_normplug_args

MODEL = "transformer_normplug"


def _default(args, **values):
    for name, value in values.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


@register_model_architecture(MODEL, MODEL)
def normplug_base_architecture(args):
    """Stock ``transformer`` sizes (base: d=512, FFN 2048, 8 heads, 6+6 layers). Also
    validates the plugin flags, so bad input fails at argument time, before data is read."""
    base_architecture(args)
    resolve_normplug_args(args)
    bf16_without_tpu(args)


@register_model_architecture(MODEL, MODEL + "_ted")
def normplug_ted(args):
    """The paper's TED setting: base size, dropout 0.3 on sublayer outputs, attention weights
    and FFN hidden units, target embeddings tied to the output layer."""
    _default(args, dropout=0.3, attention_dropout=0.3, activation_dropout=0.3,
             share_decoder_input_output_embed=True)
    normplug_base_architecture(args)


@register_model_architecture(MODEL, MODEL + "_wmt_en_de")
def normplug_wmt_en_de(args):
    """WMT'14 en-de base (fairseq's recipe): base size, dropout 0.1, all embeddings shared."""
    _default(args, share_all_embeddings=True)
    normplug_base_architecture(args)


@register_model_architecture(MODEL, MODEL + "_wmt_en_de_big")
def normplug_wmt_en_de_big(args):
    """WMT'14 en-de big: d=1024, FFN 4096, 16 heads, dropout 0.3, all embeddings shared."""
    _default(args, encoder_embed_dim=1024, encoder_ffn_embed_dim=4096, encoder_attention_heads=16,
             decoder_embed_dim=1024, decoder_ffn_embed_dim=4096, decoder_attention_heads=16,
             dropout=0.3, share_all_embeddings=True)
    normplug_base_architecture(args)


@register_model_architecture(MODEL, MODEL + "_cpu")
def normplug_cpu(args):
    """Small model for 2-core CPU runs (demo, benchmarks): d=256, FFN 1024, 4 heads, 3+3
    layers, tied target embeddings (~1,100 target tokens/s on 2 cores)."""
    _default(args, encoder_embed_dim=256, encoder_ffn_embed_dim=1024, encoder_attention_heads=4,
             encoder_layers=3, decoder_embed_dim=256, decoder_ffn_embed_dim=1024,
             decoder_attention_heads=4, decoder_layers=3, share_decoder_input_output_embed=True)
    normplug_base_architecture(args)


@register_model_architecture(MODEL, MODEL + "_tiny")
def normplug_tiny(args):
    """Tiny model for tests: d=64, FFN 128, 2 heads, 2+2 layers, tied target embeddings."""
    _default(args, encoder_embed_dim=64, encoder_ffn_embed_dim=128, encoder_attention_heads=2,
             encoder_layers=2, decoder_embed_dim=64, decoder_ffn_embed_dim=128,
             decoder_attention_heads=2, decoder_layers=2, share_decoder_input_output_embed=True)
    normplug_base_architecture(args)


@register_model_architecture(MODEL, MODEL + "_mini")
def normplug_mini(args):
    """The ``cpu_converge`` recipe's model (docs/results.md): d=64, FFN 256, 4 heads, 3+3
    layers, dropout 0.1 (fairseq's default), target embeddings tied; in fairseq-train about
    2,400-2,900 target tokens/s per CPU core with a 4k vocabulary."""
    _default(args, encoder_embed_dim=64, encoder_ffn_embed_dim=256, encoder_attention_heads=4,
             encoder_layers=3, decoder_embed_dim=64, decoder_ffn_embed_dim=256,
             decoder_attention_heads=4, decoder_layers=3, share_decoder_input_output_embed=True)
    normplug_base_architecture(args)
