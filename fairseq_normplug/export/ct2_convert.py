"""The conversion itself: CTranslate2's own fairseq converter (``FairseqConverter``: its
``convert`` validates, optimises and saves the spec) loading a plugin checkpoint through the
plugin (:func:`fairseq_normplug.diagnostics.loading.load_checkpoint`) and writing the spec of
:mod:`fairseq_normplug.export.ct2_spec`; then the check that every export passes: greedy
translations of the first sentences of a split by the exported model and by the checkpoint
(fairseq's ``SequenceGenerator``, beam 1, in this process) must be identical."""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import ctranslate2
import torch
from ctranslate2.converters.fairseq import FairseqConverter
from fairseq.sequence_generator import SequenceGenerator

from fairseq_normplug.diagnostics.loading import LoadedCheckpoint, load_checkpoint
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.export.ct2_spec import build_spec

#: fairseq-generate's length limit (``--max-len-a 0 --max-len-b 200``), used by both decoders of the check
MAX_LEN_B = 200


class NormplugFairseqConverter(FairseqConverter):
    """CTranslate2's fairseq converter for ``transformer_normplug`` (and stock ``transformer``)
    checkpoints: the model is loaded with the plugin, its spec built from what its modules are
    (``ct2_spec.py``); ``loaded`` keeps the loaded checkpoint for the check."""

    def __init__(self, model_path: str, data_dir: str):
        super().__init__(model_path, data_dir)
        self.loaded: Optional[LoadedCheckpoint] = None

    def load(self) -> LoadedCheckpoint:
        """The checkpoint with its task and dictionaries (loaded once)."""
        if self.loaded is None:
            self.loaded = load_checkpoint(self._model_path, self._data_dir)
        return self.loaded

    def _load(self):
        loaded = self.load()
        task = loaded.task
        return build_spec(loaded.model, loaded.cfg.model, task.source_dictionary, task.target_dictionary)


@dataclass
class CheckResult:
    """The greedy translations (token lists) of the check's sentences, by both decoders."""

    split: str
    sources: List[List[str]]
    reference: List[List[str]]
    exported: List[List[str]]

    @property
    def identical(self) -> int:
        return sum(a == b for a, b in zip(self.reference, self.exported))

    def first_difference(self) -> Optional[int]:
        return next((i for i, (a, b) in enumerate(zip(self.reference, self.exported)) if a != b), None)


def max_length(model) -> int:
    """fairseq's SequenceGenerator's limit on output tokens with ``--max-len-a 0``: ``MAX_LEN_B``,
    capped by the decoder's positions."""
    return min(MAX_LEN_B, model.max_decoder_positions() - 1)


def check_sentences(loaded: LoadedCheckpoint, split: str, count: int) -> List[int]:
    """The indices of the first ``count`` sentences of ``split`` (all, if it has fewer)."""
    try:
        loaded.task.load_dataset(split)
    except FileNotFoundError:
        raise NormplugError(f"{loaded.data_bin} has no binarized {split} split to check the export "
                            f"with; pass --check_subset with a split it has (valid, test)") from None
    return list(range(min(count, len(loaded.task.dataset(split)))))


def fairseq_greedy(loaded: LoadedCheckpoint, split: str, indices: List[int]) -> Tuple[List[List[str]], List[List[str]]]:
    """(source tokens, greedy translation tokens) of ``indices`` by the checkpoint itself:
    fairseq's SequenceGenerator with beam 1, fairseq-generate's defaults otherwise."""
    task, model = loaded.task, loaded.model
    dataset = task.dataset(split)
    sample = dataset.collater([dataset[i] for i in indices])
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=1, max_len_a=0, max_len_b=MAX_LEN_B)
    with torch.no_grad():
        hypotheses = generator.generate([model], sample)
    by_id = {int(i): hypos[0]["tokens"] for i, hypos in zip(sample["id"], hypotheses)}
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    sources = [[src_dict[t] for t in dataset[i]["source"].tolist() if t != src_dict.eos()] for i in indices]
    translations = [[tgt_dict[t] for t in by_id[i].tolist() if t != tgt_dict.eos()] for i in indices]
    return sources, translations


def ctranslate2_greedy(model_dir: str, sources: List[List[str]], max_decoding_length: int) -> List[List[str]]:
    """Greedy translations of ``sources`` by the exported model on the CPU in float32, with
    fairseq's limits: at least one token before </s> (its ``min_len`` 1), at most ``max_decoding_length``."""
    translator = ctranslate2.Translator(model_dir, device="cpu", compute_type="float32", intra_threads=1)
    results = translator.translate_batch(sources, beam_size=1, max_decoding_length=max_decoding_length,
                                         min_decoding_length=1)
    return [result.hypotheses[0] for result in results]


def check_export(converter: NormplugFairseqConverter, model_dir: str, split: str, count: int) -> CheckResult:
    """Compare the greedy translations of the first ``count`` sentences of ``split`` (module docstring)."""
    loaded = converter.load()
    indices = check_sentences(loaded, split, count)
    sources, reference = fairseq_greedy(loaded, split, indices)
    exported = ctranslate2_greedy(model_dir, sources, max_length(loaded.model))
    return CheckResult(split, sources, reference, exported)


def shown(tokens: List[str], limit: int = 12) -> str:
    """The first ``limit`` tokens of a translation, for a one-line message."""
    return " ".join(tokens[:limit]) + (f" ... ({len(tokens)} tokens)" if len(tokens) > limit else "")


def refuse_difference(result: CheckResult, output_dir: str) -> None:
    """A failed check as one line: how many agree, and the first sentence that does not."""
    first = result.first_difference()
    if first is None:
        return
    raise NormplugError(
        f"the CTranslate2 export translates {result.split} sentence {first} differently from the checkpoint "
        f"(greedy: {shown(result.exported[first])!r} instead of {shown(result.reference[first])!r}; "
        f"{result.identical}/{len(result.reference)} identical); nothing was written to {output_dir}")


def convert_and_check(model_path: str, data_dir: str, work_dir: str, split: str, count: int,
                      vocab_mapping: Optional[str] = None) -> CheckResult:
    """Convert ``model_path`` into ``work_dir`` (a fresh folder: CTranslate2's ``convert``
    replaces it; ``vocab_mapping`` copied in as its converter does) and check it; a refusal or a
    failed check raises NormplugError."""
    converter = NormplugFairseqConverter(model_path, data_dir)
    converter.convert(work_dir, vmap=vocab_mapping, force=True)
    return check_export(converter, work_dir, split, count)
