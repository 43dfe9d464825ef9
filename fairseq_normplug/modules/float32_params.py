"""Scalar norm parameters (ScaleNorm's g, DyT's and Derf's alpha, ...) stay float32 in fp16/bf16 models.

fairseq's ``--fp16`` / ``--bf16`` cast the whole model with ``model.half()`` /
``model.to(torch.bfloat16)``. A scalar's gradient is a sum over every element of a batch:
under fp16 loss scaling it overflows 65504 long before any other gradient does (each
overflow skips an update and halves the loss scale), and a bf16 g of ~22 moves in steps of
0.125. Kept float32, its gradient is summed, accumulated (``--update-freq``) and stored in
float32; fairseq's FP16Optimizer / MemoryEfficientFP16Optimizer / AMP handle parameters of
mixed dtypes (their fp32 master copy or fp32 update math covers fp16, bf16 and fp32 alike).
"""
import torch
from torch import nn

HALF_DTYPES = (torch.float16, torch.bfloat16)


class Float32Params(nn.Module):
    """A module whose own scalar (0-dim) parameters are cast back to float32 whenever a
    ``.half()`` / ``.bfloat16()`` / ``.to(dtype)`` would make them fp16/bf16 (float64, e.g.
    for gradcheck, is left alone). Its forward must cast its output to the input's dtype."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for param in self.parameters(recurse=False):
            if param.dim() == 0 and param.dtype in HALF_DTYPES:
                param.data = param.data.float()
                if param.grad is not None:
                    param.grad = param.grad.float()
        return self
