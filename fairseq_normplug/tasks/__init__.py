"""The registered ``translation_normplug`` task (word dropout, GNMT length normalisation)."""
from fairseq_normplug.tasks.translation_normplug import TranslationNormplugTask

__all__ = ["TranslationNormplugTask"]
