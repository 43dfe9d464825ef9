"""Joint subword models learned on both sides of the (filtered) training text.

``subword_nmt`` (default): ``subword-nmt learn-bpe -s N`` on the concatenation of the two
training sides, as fairseq's recipes do, then ``apply-bpe`` (``@@ `` continuation marks;
``fairseq-generate --remove-bpe`` undoes it). ``sentencepiece``: a BPE-type sentencepiece
model of vocabulary size N on the same text (``--post-process sentencepiece`` undoes it).
Default sizes come from ``configs/bpe.json``.
"""
import functools
import json
import os
import shutil
from typing import Callable, List

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.prepare.text import count_lines, open_text
from fairseq_normplug.resources import CONFIG_DIR

CONFIG = os.path.join(CONFIG_DIR, "bpe.json")
#: Sentences sentencepiece samples for training (it holds them in memory).
SPM_SENTENCE_SAMPLE = 5_000_000


def default_merges(corpus: str, src: str, tgt: str) -> int:
    """Default size from ``configs/bpe.json``: the pair's entry (either direction), else the
    corpus's, else the global default."""
    try:
        with open(CONFIG, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise NormplugError(f"cannot read the BPE defaults {CONFIG} ({exc}); pass --bpe-merges") from None
    pairs = config.get("pair", {})
    for pair in (f"{src}-{tgt}", f"{tgt}-{src}"):
        if pair in pairs:
            return int(pairs[pair])
    return int(config.get("corpus", {}).get(corpus, config["default"]))


class SubwordNmt:
    """subword-nmt BPE: model file ``codes``."""

    name = "subword_nmt"
    module = "subword_nmt"

    def learn(self, train_text: str, model_dir: str, merges: int, workers: int) -> str:
        """Learn from ``train_text``; return the equivalent command for the manifest."""
        from subword_nmt.learn_bpe import learn_bpe

        codes = os.path.join(model_dir, "codes")
        with open_text(train_text) as infile, open_text(codes, "w") as outfile:
            learn_bpe(infile, outfile, merges, num_workers=workers)  # shows its own progress bar
        return f"subword-nmt learn-bpe -s {merges} < train.SRC+TGT > bpe/codes"

    def describe_apply(self) -> str:
        return "subword-nmt apply-bpe -c bpe/codes"

    def segmenter(self, model_dir: str) -> Callable[[], Callable[[str], str]]:
        return functools.partial(_subword_nmt_segmenter, os.path.join(model_dir, "codes"))

    def model_stats(self, model_dir: str) -> dict:
        return {"model": "bpe/codes", "merges_learned": count_lines(os.path.join(model_dir, "codes")) - 1}


class SentencePiece:
    """sentencepiece, model type BPE: model files ``spm.model`` and ``spm.vocab``."""

    name = "sentencepiece"
    module = "sentencepiece"

    def learn(self, train_text: str, model_dir: str, merges: int, workers: int) -> str:
        import sentencepiece

        options = dict(model_type="bpe", vocab_size=merges, character_coverage=1.0,
                       hard_vocab_limit=False, input_sentence_size=SPM_SENTENCE_SAMPLE,
                       shuffle_input_sentence=True)
        sentencepiece.SentencePieceTrainer.train(
            input=train_text, model_prefix=os.path.join(model_dir, "spm"), num_threads=workers,
            minloglevel=2, **options)
        flags = " ".join(f"--{key}={value}" for key, value in options.items())
        return f"spm_train --input=train.SRC+TGT --model_prefix=bpe/spm {flags}"

    def describe_apply(self) -> str:
        return "spm_encode --model=bpe/spm.model --output_format=piece"

    def segmenter(self, model_dir: str) -> Callable[[], Callable[[str], str]]:
        return functools.partial(_sentencepiece_segmenter, os.path.join(model_dir, "spm.model"))

    def model_stats(self, model_dir: str) -> dict:
        return {"model": "bpe/spm.model", "pieces": count_lines(os.path.join(model_dir, "spm.vocab"))}


METHODS = {method.name: method for method in (SubwordNmt(), SentencePiece())}


def _subword_nmt_segmenter(codes: str) -> Callable[[str], str]:
    from subword_nmt.apply_bpe import BPE

    with open_text(codes) as f:
        bpe = BPE(f)
    return bpe.segment


def _sentencepiece_segmenter(model: str) -> Callable[[str], str]:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    return lambda line: " ".join(processor.encode(line, out_type=str))


def learn_input(train_files: List[str], path: str) -> None:
    """Concatenate the training sides into the one text the joint model is learned on."""
    with open(path, "wb") as out:
        for name in train_files:
            with open(name, "rb") as f:
                shutil.copyfileobj(f, out)
