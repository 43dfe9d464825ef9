"""The registered ``translation_normplug`` task (word dropout, GNMT length normalisation, the
authors' beam search, each sentence's own decoding length cap)."""
from fairseq_normplug.tasks.translation_normplug import TranslationNormplugTask

__all__ = ["TranslationNormplugTask"]
