"""Learnable embedding scale (``--embed-scale learnable``): the constant that multiplies the
token embeddings (fairseq's ``embed_scale``: sqrt(d), or 1 with ``--no-scale-embedding``)
becomes a learnable scalar starting at that value, as in the LLM recipe of "Transformers
without Normalization" (Zhu et al. 2025, Appendix A, LLaMA: a learnable scalar after the
embeddings, initialised to the square root of the model dimension). fairseq's encoder and decoder compute
``embed_scale * embed_tokens(tokens)``, so a parameter in that attribute is all it takes;
encoder and decoder each get their own scalar.
"""
import torch
from torch import nn

EMBED_SCALES = ("fixed", "learnable")


def make_embed_scale_learnable(model) -> None:
    for stack in (model.encoder, model.decoder):
        stack.embed_scale = nn.Parameter(torch.tensor(float(stack.embed_scale)))
