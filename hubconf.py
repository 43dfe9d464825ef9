"""torch.hub entry points: ``torch.hub.load(REPO, "transformer_normplug", CKPT_DIR,
source="local")`` with REPO a checkout of this repository (or ``"OWNER/fairseq-normplug"``
from GitHub) loads a checkpoint folder written by the project's training (the dictionaries
and subword model beside the checkpoints) as fairseq's GeneratorHubInterface:
``model.translate("raw source text")``. See fairseq_normplug/hub.py."""
dependencies = ["torch", "fairseq"]


def transformer_normplug(checkpoint_dir: str, checkpoint_file: str = "checkpoint_best.pt", **kwargs):
    """The ``transformer_normplug`` checkpoint ``checkpoint_dir/checkpoint_file``, ready to
    translate; ``kwargs`` go to fairseq's ``from_pretrained`` (``beam=5``, ``tokenizer=None``,
    ``bpe=...``)."""
    from fairseq_normplug.models import TransformerNormplugModel

    return TransformerNormplugModel.from_pretrained(checkpoint_dir, checkpoint_file, **kwargs)
