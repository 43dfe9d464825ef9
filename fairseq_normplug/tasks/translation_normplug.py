"""``--task translation_normplug``: fairseq's ``translation`` task plus the two parts of the
paper's recipe that are not model flags (NOTES.md, TED recipe):

* ``--word-dropout P``: in training only, each non-special token of the source and of the
  decoder input becomes ``<unk>`` with probability P (targets untouched). P = 0 (default)
  draws no random number at all, so training is bit-identical to ``--task translation``.
* dev BLEU with ``--eval-tokenized-bleu`` is unsmoothed, like ``multi-bleu.perl`` and the test
  score (fairseq's translation task hard-codes sacreBLEU's ``exp`` smoothing, which differs
  from the paper's metric when an n-gram precision is 0).
* ``--gnmt-alpha A``: beam search ranks finished hypotheses by GNMT length normalisation,
  log P(Y|X) / ((5 + |Y|) / 6) ** A (Wu et al. 2016, eq. 14; |Y| counts EOS), instead of
  fairseq's ``--lenpen``. Off by default (fairseq's ``--lenpen`` applies as usual).
* ``--gnmt-search`` (with ``--gnmt-alpha A``): the authors' beam search instead of fairseq's,
  normalised scores ranking every candidate at every step (gnmt_search.py).
* the decoding length cap is **per sentence**: each sentence stops at ``max_len_a`` x its own
  source length (EOS counted) + ``max_len_b`` (length_cap.py), so hypotheses do not depend on
  the batching; ``--batch-length-cap`` restores fairseq's cap from the longest source of the
  batch.

Every decoding option holds for fairseq-generate, fairseq-interactive (both take
``--task translation_normplug ...``) and fairseq-train's dev BLEU (``--eval-bleu``: the task
builds its generator through :meth:`build_generator`).

* ``--ngpt`` models: ``optimizer_step`` puts their weight rows back on the unit sphere right
  after every optimizer step (``models/placements/ngpt.py``, ``normalize_matrices``).
* ``--resume-batches uninterrupted`` (default): a resumed run trains on the batches an
  uninterrupted run trains on, so a killed and re-run job is bit-identical to one that was
  never stopped (:mod:`fairseq_normplug.tasks.resume_batches`; ``fairseq`` keeps stock
  fairseq's batches, which change with the epoch a run was resumed in). A fresh run is the
  same either way.

Word dropout's random draws come from a generator of their own, seeded from fairseq's
per-update seed (``--seed`` + update number, which fairseq sets before every update), the
data-parallel rank and the micro-batch index within the update: deterministic per seed and
across resumes, different on every rank and micro-batch, and they never shift the model's
dropout masks.
"""
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.dataclass import ChoiceEnum
from fairseq.logging import metrics
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.fairseq_parsing import one_line_errors, parse_in_progress
from fairseq_normplug.models.placements.ngpt import normalize_matrices
from fairseq_normplug.tasks.gnmt_generator import GnmtSequenceGenerator
from fairseq_normplug.tasks.gnmt_search import GnmtBeamSearchGenerator
from fairseq_normplug.tasks.length_cap import cap_each_sentence
from fairseq_normplug.tasks.resume_batches import RESUME_BATCHES, first_epoch_seeds
from fairseq_normplug.tasks.word_dropout import word_dropout


@dataclass
class TranslationNormplugConfig(TranslationConfig):
    word_dropout: float = field(default=0.0, metadata={
        "help": "training only: replace each non-special source and decoder-input token by <unk> "
                "with this probability (the paper's TED recipe: 0.1)"})
    gnmt_alpha: Optional[float] = field(default=None, metadata={
        "help": "beam search: GNMT length normalisation log P / ((5 + |Y|) / 6) ** alpha (the paper: "
                "0.6), replacing --lenpen; default off"})
    resume_batches: ChoiceEnum(RESUME_BATCHES) = field(default="uninterrupted", metadata={
        "help": "batches of a resumed run: 'uninterrupted' = those an uninterrupted run trains on "
                "(bit-identical resume); 'fairseq' = stock fairseq, rebuilt at the resumed epoch"})
    # fairseq's --update-ordered-indices-seed (the trainer then passes --seed + epoch as seed)
    update_ordered_indices_seed: bool = II("dataset.update_ordered_indices_seed")
    gnmt_search: bool = field(default=False, metadata={
        "help": "the authors' beam search (needs --gnmt-alpha): GNMT-normalised scores rank every "
                "candidate at every step, an ended hypothesis keeps its score and its slot, a sentence "
                "ends when every slot has ended or at its length cap; --lenpen is not used"})
    batch_length_cap: bool = field(default=False, metadata={
        "help": "decode with fairseq's batch length cap, max_len_a x the longest source of the batch + "
                "max_len_b, instead of each sentence's own (max_len_a x its source length, EOS counted, "
                "+ max_len_b); hypotheses then depend on the batching"})


def check_config(cfg) -> None:
    """One-line errors for out-of-range values, at task set-up (before any training)."""
    if not 0 <= cfg.word_dropout < 1:
        raise NormplugError(f"--word-dropout must be in [0, 1), got {cfg.word_dropout}")
    if cfg.gnmt_alpha is not None and cfg.gnmt_alpha < 0:
        raise NormplugError(f"--gnmt-alpha must be >= 0 (or left out: fairseq's --lenpen), got {cfg.gnmt_alpha}")
    if cfg.gnmt_search and cfg.gnmt_alpha is None:
        raise NormplugError("--gnmt-search needs --gnmt-alpha A (the paper: 0.6; 0 ranks by log P alone)")


def check_gnmt_search_args(args, prefix_allowed_tokens_fn=None, extra_gen_cls_kwargs=None) -> None:
    """One-line error for a fairseq generation option that --gnmt-search does not implement."""
    given = {
        "--sampling": getattr(args, "sampling", False),
        "--diverse-beam-groups": getattr(args, "diverse_beam_groups", -1) > 0,
        "--diversity-rate": getattr(args, "diversity_rate", -1) > -1,
        "--match-source-len": getattr(args, "match_source_len", False),
        "--constraints": getattr(args, "constraints", None),
        "--print-alignment": getattr(args, "print_alignment", None),
        "--no-repeat-ngram-size": getattr(args, "no_repeat_ngram_size", 0) > 0,
        "prefix_allowed_tokens_fn": prefix_allowed_tokens_fn or getattr(args, "prefix_allowed_tokens_fn", None),
        "--lm-path": (extra_gen_cls_kwargs or {}).get("lm_model") is not None,
    }
    for flag, on in given.items():
        if on:
            raise NormplugError(f"--gnmt-search does not support {flag}; leave one of them out")


def unsmoothed_bleu(meters) -> float:
    """Corpus BLEU of the summed dev n-gram statistics without smoothing (multi-bleu.perl)."""
    from sacrebleu.metrics import BLEU

    bleu = BLEU.compute_bleu(correct=meters["_bleu_counts"].sum, total=meters["_bleu_totals"].sum,
                             sys_len=int(meters["_bleu_sys_len"].sum), ref_len=int(meters["_bleu_ref_len"].sum),
                             smooth_method="none")
    return round(bleu.score, 2)


def _config_flag(cfg, name: str) -> bool:
    """A boolean task-config value that may be missing or unresolvable (a task config built
    outside fairseq-train, or saved by an older version): False then."""
    try:
        return bool(getattr(cfg, name, False))
    except Exception:  # omegaconf's interpolation errors when the config has no parent
        return False


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


@register_task("translation_normplug", dataclass=TranslationNormplugConfig)
class TranslationNormplugTask(TranslationTask):
    """fairseq's translation task with word dropout, GNMT length normalisation or the authors'
    beam search, and the per-sentence decoding length cap."""

    @classmethod
    def add_args(cls, parser):
        """The task's flags (its dataclass); fairseq's parser errors become one line, the nearest
        flag or choice named (fairseq-generate and fairseq-interactive add no model flags)."""
        one_line_errors(parse_in_progress().parser)
        super().add_args(parser)

    @classmethod
    def setup_task(cls, cfg, **kwargs):
        check_config(cfg)
        return super().setup_task(cfg, **kwargs)

    def __init__(self, cfg, src_dict, tgt_dict):
        super().__init__(cfg, src_dict, tgt_dict)
        self._micro_batch = (None, 0)  # (update number, micro-batches seen in it)

    def word_dropout_generator(self, update_num: int) -> torch.Generator:
        """The generator of this micro-batch's word-dropout draws (see the module docstring)."""
        update, count = self._micro_batch
        count = count + 1 if update == update_num else 0
        self._micro_batch = (update_num, count)
        seed = (torch.initial_seed() * 1_000_003 + _rank() * 1009 + count) % (2 ** 63)
        return torch.Generator().manual_seed(seed)

    def apply_word_dropout(self, sample: dict, generator: torch.Generator) -> dict:
        """A copy of ``sample`` whose src_tokens and prev_output_tokens went through word dropout."""
        p = self.cfg.word_dropout
        net_input = dict(sample["net_input"])
        net_input["src_tokens"] = word_dropout(net_input["src_tokens"], p, self.src_dict, generator)
        if "prev_output_tokens" in net_input:
            net_input["prev_output_tokens"] = word_dropout(net_input["prev_output_tokens"], p,
                                                           self.tgt_dict, generator)
        return {**sample, "net_input": net_input}

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        if self.cfg.word_dropout > 0 and sample:
            sample = self.apply_word_dropout(sample, self.word_dropout_generator(update_num))
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        normalize_matrices(model, optimizer)  # --ngpt: weight rows back on the unit sphere

    def get_batch_iterator(self, dataset, max_tokens=None, max_sentences=None, max_positions=None,
                           ignore_invalid_inputs=False, required_batch_size_multiple=1, seed=1, num_shards=1,
                           shard_id=0, num_workers=0, epoch=1, data_buffer_size=0, disable_iterator_cache=False,
                           skip_remainder_batch=False, grouped_shuffling=False, update_epoch_batch_itr=False):
        """fairseq's iterator, with the batches (and per-epoch shuffle seed) an uninterrupted run
        has at ``epoch`` (see :mod:`fairseq_normplug.tasks.resume_batches`)."""
        cached = (not disable_iterator_cache and not update_epoch_batch_itr and self.can_reuse_epoch_itr(dataset)
                  and not getattr(self.cfg, "rebuild_batches", False))  # else fairseq rebuilds every epoch
        pinned = epoch > 1 and cached and getattr(self.cfg, "resume_batches", "uninterrupted") == "uninterrupted"
        seeds = first_epoch_seeds(seed, epoch, _config_flag(self.cfg, "update_ordered_indices_seed")) \
            if pinned else None
        iterator = super().get_batch_iterator(
            dataset, max_tokens=max_tokens, max_sentences=max_sentences, max_positions=max_positions,
            ignore_invalid_inputs=ignore_invalid_inputs, required_batch_size_multiple=required_batch_size_multiple,
            seed=seed if seeds is None else seeds.batching, num_shards=num_shards, shard_id=shard_id,
            num_workers=num_workers, epoch=epoch, data_buffer_size=data_buffer_size,
            disable_iterator_cache=disable_iterator_cache, skip_remainder_batch=skip_remainder_batch,
            grouped_shuffling=grouped_shuffling, update_epoch_batch_itr=update_epoch_batch_itr)
        if seeds is not None:
            iterator.seed = seeds.shuffle
        return iterator

    def reduce_metrics(self, logging_outputs, criterion):
        if self.cfg.eval_bleu and self.cfg.eval_tokenized_bleu:
            totals = [sum(log.get(f"_bleu_totals_{i}", 0) for log in logging_outputs) for i in range(4)]
            if max(totals) > 0:  # registered first, so the parent's smoothed "bleu" is not
                metrics.log_derived("bleu", unsmoothed_bleu)
        super().reduce_metrics(logging_outputs, criterion)

    def build_generator(self, models, args, seq_gen_cls=None, extra_gen_cls_kwargs=None,
                        prefix_allowed_tokens_fn=None):
        """The authors' search (--gnmt-search), or fairseq's (re-ranked with --gnmt-alpha); either
        with the per-sentence length cap unless --batch-length-cap."""
        if self.cfg.gnmt_search and seq_gen_cls is None and not getattr(args, "score_reference", False):
            check_gnmt_search_args(args, prefix_allowed_tokens_fn, extra_gen_cls_kwargs)
            return GnmtBeamSearchGenerator(
                models, self.target_dictionary, beam_size=getattr(args, "beam", 5), gnmt_alpha=self.cfg.gnmt_alpha,
                max_len_a=getattr(args, "max_len_a", 0), max_len_b=getattr(args, "max_len_b", 200),
                min_len=getattr(args, "min_len", 1), unk_penalty=getattr(args, "unkpen", 0),
                temperature=getattr(args, "temperature", 1.0), per_sentence_cap=not self.cfg.batch_length_cap)
        if self.cfg.gnmt_alpha is not None and seq_gen_cls is None:
            if getattr(args, "print_alignment", False):
                raise NormplugError("--gnmt-alpha does not support --print-alignment; leave one out")
            seq_gen_cls = GnmtSequenceGenerator
            extra_gen_cls_kwargs = {**(extra_gen_cls_kwargs or {}), "gnmt_alpha": self.cfg.gnmt_alpha}
        generator = super().build_generator(models, args, seq_gen_cls, extra_gen_cls_kwargs,
                                            prefix_allowed_tokens_fn)
        if not self.cfg.batch_length_cap and isinstance(generator, SequenceGenerator):
            cap_each_sentence(generator, getattr(args, "max_len_a", 0), getattr(args, "max_len_b", 200))
        return generator
