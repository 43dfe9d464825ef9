"""FixNorm (Nguyen & Chiang 2018) as used by "Transformers without Tears", section 2.3 and
eq. (6): every word-embedding row is l2-normalised, w / ||w||; with a tied output layer the
logits become cosines scaled by the norm of the decoder output (the ScaleNorm g when the last
norm is a ScaleNorm: eq. 6, cosine normalisation with a learned scale)."""
import torch
import torch.nn.functional as F
from torch import nn

FIXNORM_INIT_RANGE = 0.01


class FixNormEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose effective rows are ``w / ||w||``, initialised U(-0.01, 0.01).

    The padding row is all zeros: normalising it would divide by ~0 and give it a huge
    gradient (about 1e11, which wrecks gradient clipping). Its effective row is therefore
    set to exactly zero without dividing by its norm, so it receives no gradient at all.
    Row norms are computed in float32 whatever the weight's dtype (in fp16, ``eps**2``
    underflows to 0 and a tiny row's ``1/||w||`` overflows), the result is cast back.

    While the weights are fixed (eval mode and no autograd graph wanted: decoding,
    validation) the normalised matrix is computed once and reused; the cache is keyed on
    the weight's version, storage, dtype and device, so an in-place update,
    ``load_state_dict``, ``.half()`` or ``.to()`` recomputes it, and ``train()`` drops it.
    Training computes it afresh on every call, with its gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int, eps: float = 1e-6):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.eps = eps
        nn.init.uniform_(self.weight, -FIXNORM_INIT_RANGE, FIXNORM_INIT_RANGE)
        with torch.no_grad():
            self.weight[padding_idx].zero_()
        row_mask = torch.ones(num_embeddings, 1, dtype=torch.bool)
        row_mask[padding_idx] = False
        self.register_buffer("row_mask", row_mask, persistent=False)
        self._cache = None

    def normalized_weight(self) -> torch.Tensor:
        """Rows divided by their l2 norm; the padding row is exactly zero (and gets no
        gradient). Cached while the weights are fixed (class docstring)."""
        if self.training or torch.is_grad_enabled():
            return self.normalize()
        w = self.weight
        key = (w._version, w.data_ptr(), w.dtype, w.device)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self.normalize())
        return self._cache[1]

    def normalize(self) -> torch.Tensor:
        """The normalised rows, computed now (no cache): float32 row norms, pad row zero."""
        w = self.weight.float()
        inv_norm = torch.rsqrt(w.pow(2).sum(dim=1, keepdim=True).clamp(min=self.eps ** 2))
        inv_norm = torch.where(self.row_mask, inv_norm, torch.zeros_like(inv_norm))
        return (w * inv_norm).to(self.weight.dtype)

    def train(self, mode: bool = True):
        self._cache = None
        return super().train(mode)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.normalized_weight(), self.padding_idx)
