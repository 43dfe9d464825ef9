"""The plugin's criteria (registered on import): ``masked_label_smoothed_cross_entropy``."""
from fairseq_normplug.criterions import masked_label_smoothed_cross_entropy  # noqa: F401
