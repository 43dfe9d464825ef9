"""The registered ``transformer_normplug`` model and its named presets."""
from fairseq_normplug.models.transformer_normplug import TransformerNormplugModel
from fairseq_normplug.models import architectures  # noqa: F401,E402  (registers the presets)

__all__ = ["TransformerNormplugModel"]
