"""The decoding length cap of each sentence: a x its own source length + b.

fairseq's ``SequenceGenerator`` caps a whole batch at ``int(max_len_a * src_len + max_len_b)``
tokens, ``src_len`` being the padded width of the batch's ``src_tokens``: the LONGEST source
of the batch. A sentence's hypotheses therefore depend on which sentences share its batch
(``--max-tokens``, ``--batch-size``, the data order). The authors' decoder caps every sentence
at its own length (model.py ``beam_decode``: ``max_lengths = sum(src != PAD) + 50`` per row).

The cap of sentence i, in fairseq's meaning of ``max_len`` (the tokens a hypothesis may have
before its end-of-sentence token; the EOS itself is not counted):

    cap_i = int(max_len_a * |x_i| + max_len_b), at most max_decoder_positions - 1, at least min_len

where |x_i| is the source's length **with** its EOS (fairseq's ``src_lengths``; the authors'
``src != PAD`` count, their source lines ending in EOS too). A batch of one sentence gets
exactly fairseq's cap, so the per-sentence cap is fairseq's cap with every sentence decoded in
a batch of its own. The authors' "source + 50" is max_len_a = 1, max_len_b = 50: at most
|x| + 50 output tokens, the authors' ``max_lengths`` (their hypotheses hold at most that many
symbols: docs/fidelity.md, "decoding length").

:class:`LengthCappedEnsembleModel` applies the caps inside fairseq's beam search: after every
decoder step it leaves only EOS open on the rows (sentence x beam) whose own cap is reached,
reading each row's source length from the encoder output (``src_lengths``, which
``reorder_encoder_out`` reorders with the beams and with finished sentences). fairseq's batch
cap still ends the loop; it is never below a row's cap.
"""
import math
from typing import Dict, List, Optional

import torch
from fairseq.sequence_generator import EnsembleModel, EnsembleModelWithAlignment, SequenceGenerator
from torch import Tensor

from fairseq_normplug.errors import NormplugError


class SentenceLengthCap:
    """``cap_i = int(a * |x_i| + b)`` clipped to [min_len, limit] (module docstring), or with
    ``per_sentence=False`` fairseq's batch cap (|x| = the padded width) on every row."""

    def __init__(self, max_len_a: float, max_len_b: float, limit: int, min_len: int = 1,
                 per_sentence: bool = True):
        self.max_len_a = float(max_len_a)
        self.max_len_b = float(max_len_b)
        self.limit = int(limit)
        self.min_len = int(min_len)
        self.per_sentence = per_sentence

    def __call__(self, src_lengths: Tensor, src_width: Optional[int] = None) -> Tensor:
        """The cap of each row of ``src_lengths`` (EOS included) as a LongTensor of its shape."""
        lengths = src_lengths.reshape(-1).double()
        if not self.per_sentence:
            if src_width is None:
                raise ValueError("a batch cap needs the padded source width")
            lengths = torch.full_like(lengths, float(src_width))
        # two roundings, as Python computes fairseq's int(a * src_len + b); int() truncates
        caps = torch.trunc(lengths * self.max_len_a + self.max_len_b).long()
        return caps.clamp(max=self.limit).clamp(min=self.min_len)


def force_eos_at_cap(lprobs: Tensor, step: int, caps: Tensor, eos: int) -> Tensor:
    """Leave only EOS open (every other log-probability -inf, in place) on the rows of
    ``lprobs`` (rows x vocabulary) whose cap is reached: at ``step`` a hypothesis holds
    ``step`` tokens, so a row with ``step >= cap`` must end now (fairseq's own rule for its
    batch cap, ``step >= max_len``)."""
    capped = caps.to(lprobs.device) <= step
    if capped.any():
        eos_lprobs = lprobs[capped, eos].clone()
        lprobs[capped] = -math.inf
        lprobs[capped, eos] = eos_lprobs
    return lprobs


def encoder_src_lengths(encoder_outs) -> Tensor:
    """Each decoder row's source length (EOS included) from the first model's encoder output."""
    if not encoder_outs or not encoder_outs[0].get("src_lengths"):
        raise NormplugError("the per-sentence length cap needs an encoder output with 'src_lengths' "
                            "(fairseq's transformer encoder); decode with --batch-length-cap instead")
    return encoder_outs[0]["src_lengths"][0].reshape(-1)


class _PerSentenceCap:
    """Mixin of fairseq ensembles: ``forward_decoder`` ends the rows whose own cap is reached."""

    def __init__(self, models, length_cap: SentenceLengthCap, eos: int):
        super().__init__(models)
        self.length_cap = length_cap
        self.eos = eos

    def forward_decoder(self, tokens, encoder_outs: List[Dict[str, List[Tensor]]],
                        incremental_states: List[Dict[str, Dict[str, Optional[Tensor]]]],
                        temperature: float = 1.0):
        lprobs, attn = super().forward_decoder(tokens, encoder_outs, incremental_states, temperature)
        caps = self.length_cap(encoder_src_lengths(encoder_outs))
        return force_eos_at_cap(lprobs, tokens.size(1) - 1, caps, self.eos), attn


class LengthCappedEnsembleModel(_PerSentenceCap, EnsembleModel):
    """fairseq's ``EnsembleModel`` with the per-sentence length cap."""


class LengthCappedEnsembleModelWithAlignment(_PerSentenceCap, EnsembleModelWithAlignment):
    """fairseq's ``EnsembleModelWithAlignment`` (``--print-alignment``) with the per-sentence cap."""


def cap_each_sentence(generator: SequenceGenerator, max_len_a: float, max_len_b: float) -> SequenceGenerator:
    """Give a built ``SequenceGenerator`` (or subclass) the per-sentence cap: its ensemble is
    rebuilt, over the same models, as the capped ensemble of the same kind."""
    ensemble = generator.model
    kind = (LengthCappedEnsembleModelWithAlignment if isinstance(ensemble, EnsembleModelWithAlignment)
            else LengthCappedEnsembleModel)
    cap = SentenceLengthCap(max_len_a, max_len_b, limit=generator.max_len - 1, min_len=generator.min_len)
    generator.model = kind(list(ensemble.models), cap, generator.eos)
    generator.model.eval()
    return generator
