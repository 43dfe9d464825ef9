"""The authors' beam search (``--gnmt-search``): GNMT-normalised scores rank the beam at every step.

A re-implementation of ``Decoder.beam_decode`` of the authors' code (layers.py; model.py calls
it with beam 4, alpha 0.6 and ``max_lengths`` = source length + 50) on fairseq's model
interfaces (``EnsembleModel``: encoder, incremental decoder, beam reordering), so that it runs
in fairseq-generate, fairseq-interactive and fairseq-train's dev BLEU. With lp(n) the GNMT
length penalty of Wu et al. (2016), eq. 14, n counting the EOS (``gnmt_length_penalty``):

* the first step extends the start symbol only, EOS forbidden (fairseq's ``--min-len``, default
  1: EOS is closed at every step < min_len);
* at step t (each hypothesis holds t tokens) every candidate y of every open hypothesis Y is
  scored ``(log P(Y) + log P(y | Y)) / lp(t + 1)``;
* a hypothesis that has ended (its last token is EOS) keeps its score and competes for its slot:
  its only candidate is itself, at its own score;
* the beam_size best candidates of the sentence, open or ended, form the next beam (an ended
  hypothesis that no longer makes the beam is lost);
* a sentence ends when all beam_size slots hold ended hypotheses, or when its hypotheses hold
  its cap of tokens (``length_cap.SentenceLengthCap``: ``a * |x| + b`` per sentence, or
  fairseq's batch cap with ``--batch-length-cap``); a hypothesis cut there has no EOS of its
  own: the output appends one with positional score 0 (fairseq's hypothesis format), its score
  stays the authors' ``log P / lp(cap)``;
* the n-best list is the final beam sorted by score.

fairseq's ``SequenceGenerator`` instead ranks open candidates by raw log P, finalizes an EOS
candidate when it is among the beam_size best, keeps beam_size open hypotheses and closes a
sentence once beam_size hypotheses have ended; ``--gnmt-alpha`` alone only re-ranks that
finished set (gnmt_generator.py).
"""
import math
from typing import Dict, List, Optional

import torch
from fairseq.sequence_generator import EnsembleModel
from torch import Tensor, nn

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.tasks.gnmt_generator import gnmt_length_penalty
from fairseq_normplug.tasks.length_cap import SentenceLengthCap


class GnmtBeamSearchGenerator(nn.Module):
    """The authors' beam search (module docstring) with fairseq's generator interface."""

    def __init__(self, models, tgt_dict, beam_size: int = 4, gnmt_alpha: float = 0.6,
                 max_len_a: float = 0, max_len_b: float = 200, min_len: int = 1,
                 unk_penalty: float = 0.0, temperature: float = 1.0, per_sentence_cap: bool = True):
        super().__init__()
        self.model = models if isinstance(models, EnsembleModel) else EnsembleModel(models)
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.symbols_to_strip_from_output = {self.eos}
        self.vocab_size = len(tgt_dict)
        self.beam_size = min(beam_size, self.vocab_size - 1)  # pad is never chosen (as fairseq)
        self.gnmt_alpha = float(gnmt_alpha)
        self.min_len = min_len
        self.unk_penalty = unk_penalty
        if temperature <= 0:
            raise NormplugError(f"--temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.length_cap = SentenceLengthCap(max_len_a, max_len_b, limit=self.model.max_decoder_positions() - 1,
                                            min_len=max(min_len, 1), per_sentence=per_sentence_cap)
        self.model.set_decoder_beam_size(self.beam_size)
        self.model.eval()

    def cuda(self):
        self.model.cuda()
        return self

    @torch.no_grad()
    def forward(self, sample, prefix_tokens=None, bos_token=None):
        return self.generate(self.model.models, sample, prefix_tokens=prefix_tokens, bos_token=bos_token)

    @torch.no_grad()
    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], prefix_tokens: Optional[Tensor] = None,
                 constraints: Optional[Tensor] = None, bos_token: Optional[int] = None, **kwargs):
        """n-best lists (one per sentence of ``sample``) of fairseq hypothesis dicts."""
        if prefix_tokens is not None or constraints is not None:
            raise NormplugError("--gnmt-search does not support --prefix-size or --constraints; leave them out")
        return self._search(sample["net_input"], self.eos if bos_token is None else bos_token)

    def _search(self, net_input: Dict[str, Tensor], bos: int) -> List[List[Dict[str, Tensor]]]:
        src_tokens = net_input["src_tokens"]
        src_lengths = net_input.get("src_lengths")
        if src_lengths is None:
            src_lengths = src_tokens.ne(self.pad).long().sum(dim=1)
        bsz, beam, vocab = src_tokens.size(0), self.beam_size, self.vocab_size
        device = src_tokens.device
        caps = self.length_cap(src_lengths, src_tokens.size(1)).to(device)  # tokens per hypothesis

        encoder_outs = self.model.forward_encoder(net_input)
        expand = torch.arange(bsz, device=device).repeat_interleave(beam)
        encoder_outs = self.model.reorder_encoder_out(encoder_outs, expand)
        incremental_states = torch.jit.annotate(List[Dict[str, Dict[str, Optional[Tensor]]]],
                                                [{} for _ in range(self.model.models_size)])

        sentence = torch.arange(bsz, device=device)  # original index of each sentence still searched
        tokens = torch.full((bsz * beam, 1), bos, dtype=torch.long, device=device)
        token_lprobs = torch.zeros(bsz * beam, 0, device=device)  # log P of each token (0 after EOS)
        log_p = torch.zeros(bsz, beam, device=device)  # the authors' last_probs
        score = torch.zeros(bsz, beam, device=device)  # the authors' last_scores
        length = torch.zeros(bsz, beam, dtype=torch.long, device=device)  # tokens up to the EOS
        ended = torch.zeros(bsz, beam, dtype=torch.bool, device=device)
        finalized: List[Optional[List[Dict[str, Tensor]]]] = [None] * bsz
        reorder: Optional[Tensor] = None  # (sentences, beam): the rows the next beam came from

        for step in range(int(caps.max()) + 1):
            if step > 0:
                done = ended.all(dim=1) | (caps <= step)
                if done.any():
                    for i in done.nonzero().view(-1).tolist():
                        finalized[sentence[i]] = self._nbest(tokens.view(-1, beam, step + 1)[i],
                                                             token_lprobs.view(-1, beam, step)[i],
                                                             score[i], length[i], ended[i])
                    keep = ~done
                    if not keep.any():
                        break
                    sentence, caps, reorder = sentence[keep], caps[keep], reorder[keep]
                    log_p, score, length, ended = log_p[keep], score[keep], length[keep], ended[keep]
                    rows = keep.repeat_interleave(beam)
                    tokens, token_lprobs = tokens[rows], token_lprobs[rows]
            if reorder is not None:
                flat = reorder.view(-1)
                self.model.reorder_incremental_state(incremental_states, flat)
                encoder_outs = self.model.reorder_encoder_out(encoder_outs, flat)

            lprobs, _ = self.model.forward_decoder(tokens, encoder_outs, incremental_states, self.temperature)
            lprobs[lprobs != lprobs] = -math.inf
            lprobs[:, self.pad] = -math.inf
            lprobs[:, self.unk] -= self.unk_penalty
            if step < self.min_len:
                lprobs[:, self.eos] = -math.inf
            n = sentence.numel()
            lprobs = lprobs.view(n, beam, vocab)

            candidate_log_p = log_p.unsqueeze(2) + lprobs
            candidate_score = candidate_log_p / gnmt_length_penalty(step + 1, self.gnmt_alpha)
            if step == 0:  # all beams hold the start symbol: extend the first one only
                candidate_score[:, 1:] = -math.inf
            if ended.any():  # an ended hypothesis competes as itself, at its own score
                candidate_log_p[ended] = -math.inf
                candidate_log_p[ended, self.eos] = log_p[ended]
                candidate_score[ended] = -math.inf
                candidate_score[ended, self.eos] = score[ended]

            score, best = torch.topk(candidate_score.view(n, -1), beam, dim=1)
            parent = torch.div(best, vocab, rounding_mode="floor")
            word = best - parent * vocab
            log_p = candidate_log_p.view(n, -1).gather(1, best)
            parent_ended = ended.gather(1, parent)
            word_lprob = lprobs.view(n, -1).gather(1, best).masked_fill(parent_ended, 0.0)
            length = torch.where(parent_ended, length.gather(1, parent), torch.full_like(length, step + 1))
            ended = parent_ended | word.eq(self.eos)

            reorder = parent + (torch.arange(n, device=device) * beam).unsqueeze(1)
            rows = reorder.view(-1)
            tokens = torch.cat([tokens[rows], word.view(-1, 1)], dim=1)
            token_lprobs = torch.cat([token_lprobs[rows], word_lprob.view(-1, 1)], dim=1)
        return finalized

    def _nbest(self, tokens: Tensor, token_lprobs: Tensor, score: Tensor, length: Tensor,
               ended: Tensor) -> List[Dict[str, Tensor]]:
        """One sentence's final beam as fairseq hypotheses, best score first. ``tokens`` holds the
        start symbol then ``steps`` tokens per slot; a slot cut at the cap gets an EOS appended."""
        steps = token_lprobs.size(1)
        hypos = []
        for k in range(tokens.size(0)):
            if bool(ended[k]):
                n = int(length[k])
                hypo_tokens, positional = tokens[k, 1:n + 1], token_lprobs[k, :n]
            else:
                eos = tokens.new_full((1,), self.eos)
                hypo_tokens = torch.cat([tokens[k, 1:steps + 1], eos])
                positional = torch.cat([token_lprobs[k, :steps], token_lprobs.new_zeros(1)])
            hypos.append({"tokens": hypo_tokens, "score": score[k], "attention": torch.empty(0),
                          "alignment": torch.empty(0), "positional_scores": positional})
        order = sorted(range(len(hypos)), key=lambda k: -float(hypos[k]["score"]))
        return [hypos[k] for k in order]
