"""FixNorm (Nguyen & Chiang 2018) as used by "Transformers without Tears", eq. (9)-(10):
every word-embedding row is l2-normalised, w / ||w||; with a tied output layer the logits
become cosines scaled by the norm of the decoder output (the ScaleNorm g when the last norm
is a ScaleNorm: cosine normalisation with a learned scale)."""
import torch
import torch.nn.functional as F
from torch import nn

FIXNORM_INIT_RANGE = 0.01


class FixNormEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose effective rows are ``w / ||w||``, initialised U(-0.01, 0.01).

    The padding row is all zeros: normalising it would divide by ~0 and give it a huge
    gradient (about 1e11, which wrecks gradient clipping). Its effective row is therefore
    masked to exactly zero, so it receives no gradient at all.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int, eps: float = 1e-6):
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.eps = eps
        nn.init.uniform_(self.weight, -FIXNORM_INIT_RANGE, FIXNORM_INIT_RANGE)
        with torch.no_grad():
            self.weight[padding_idx].zero_()
        row_mask = torch.ones(num_embeddings, 1)
        row_mask[padding_idx] = 0.0
        self.register_buffer("row_mask", row_mask, persistent=False)

    def normalized_weight(self) -> torch.Tensor:
        """Rows divided by their l2 norm; the padding row is exactly zero (and gets no gradient)."""
        sq_norm = self.weight.pow(2).sum(dim=1, keepdim=True).clamp(min=self.eps ** 2)
        return self.weight * torch.rsqrt(sq_norm) * self.row_mask.to(self.weight.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.normalized_weight(), self.padding_idx)
