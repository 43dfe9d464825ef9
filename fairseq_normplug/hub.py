"""Checkpoint folders as hub models: translate from the checkpoint folder alone.

The project's training (experiments/runner.py, so scripts/train.sh, reproduce.sh and demo.sh)
copies what fairseq's hub loader looks for next to the checkpoints (:func:`copy_hub_files`):
the dictionaries ``dict.SRC.txt`` and ``dict.TGT.txt``, and the subword model under the name
fairseq's ``hub_utils.from_pretrained`` picks up, ``bpecodes`` (subword-nmt) or
``sentencepiece.bpe.model`` (sentencepiece). Then
``TransformerNormplugModel.from_pretrained(CKPT_DIR, "checkpoint_best.pt")`` and
``torch.hub.load(REPO, "transformer_normplug", CKPT_DIR, source="local")`` (hubconf.py) load
the model without the data folder and translate raw text: :func:`hub_defaults` chooses the
subword model found there and fairseq's Moses tokenizer, as the prepare scripts tokenize.
"""
import os
from typing import Dict, Optional

from fairseq_normplug.atomic_files import copy_atomic

#: subword method (the data folder's manifest.json) -> (its model in the data folder, the name
#: fairseq's hub loader looks for in the checkpoint folder)
SUBWORD_MODELS = {"subword_nmt": (os.path.join("bpe", "codes"), "bpecodes"),
                  "sentencepiece": (os.path.join("bpe", "spm.model"), "sentencepiece.bpe.model")}
#: the tokenizer the prepare scripts tokenize with (sacremoses), as fairseq names it
TOKENIZER = "moses"


def copy_hub_files(data_dir: str, checkpoint_dir: str, src: str, tgt: str, subword_method: str) -> None:
    """Copy the dictionaries and the subword model of the prepared ``data_dir`` into
    ``checkpoint_dir`` (never half-copied; what the data folder lacks is not copied: training
    from it then fails in fairseq-train, with fairseq's own message)."""
    model, hub_name = SUBWORD_MODELS[subword_method]
    copies = {os.path.join("bin", f"dict.{lang}.txt"): f"dict.{lang}.txt" for lang in (src, tgt)}
    copies[model] = hub_name
    os.makedirs(checkpoint_dir, exist_ok=True)
    for source, name in copies.items():
        if os.path.isfile(os.path.join(data_dir, source)):
            copy_atomic(os.path.join(data_dir, source), os.path.join(checkpoint_dir, name))


def hub_defaults(checkpoint_dir: str, overrides: Dict[str, object]) -> Dict[str, object]:
    """``overrides`` (from_pretrained's keyword arguments) completed with the subword model
    :func:`copy_hub_files` left in ``checkpoint_dir`` (``bpe=``; none for a folder without one,
    e.g. a name of fairseq's model archive) and the Moses tokenizer
    (``tokenizer=``); what the caller gives wins, ``None`` included (e.g. ``tokenizer=None``
    for input that is already tokenized)."""
    found = subword_method_of(checkpoint_dir)
    defaults = {"tokenizer": TOKENIZER, **({"bpe": found} if found else {})}
    return {**defaults, **overrides}


def subword_method_of(checkpoint_dir: str) -> Optional[str]:
    """The subword method whose model :func:`copy_hub_files` copied into ``checkpoint_dir``."""
    for method, (_, hub_name) in SUBWORD_MODELS.items():
        if os.path.isfile(os.path.join(checkpoint_dir, hub_name)):
            return method
    return None
