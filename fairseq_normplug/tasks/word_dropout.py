"""Word dropout of the authors' TED recipe (NOTES.md; Sennrich et al. 2016 / Gal & Ghahramani
2016 style): during training, each non-special input token is replaced by ``<unk>`` with
probability p. Applied to the encoder input and the decoder input (the shifted target);
the training targets are never changed."""
from typing import Optional

import torch

from fairseq.data import Dictionary


def word_dropout(tokens: torch.Tensor, p: float, dictionary: Dictionary,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A copy of ``tokens`` in which each non-special token (not bos/pad/eos/unk or another
    of the dictionary's first ``nspecial`` symbols) becomes ``unk`` with probability ``p``.
    The Bernoulli draws come from ``generator`` (on the CPU), never from the global RNG."""
    if p <= 0:
        return tokens
    draws = torch.rand(tokens.shape, generator=generator).to(tokens.device)
    drop = (draws < p) & (tokens >= dictionary.nspecial)
    return tokens.masked_fill(drop, dictionary.unk())
