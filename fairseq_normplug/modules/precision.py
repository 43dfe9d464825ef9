"""Norm statistics are computed in float32 when the model runs in fp16/bf16."""
import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 if it is fp16/bf16, else unchanged (float32 and float64 stay)."""
    return t.float() if t.dtype in LOW_PRECISION else t
