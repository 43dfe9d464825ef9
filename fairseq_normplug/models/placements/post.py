"""PostNorm (Vaswani et al. 2017, "Attention Is All You Need", section 5.4 with Ba et al.
2016's LayerNorm): a norm after every residual addition, fairseq's default layer,

    x <- LN(x + Dropout(F(x))),

with no final norm after the stacks. The model is fairseq's own as built (nothing changes).
With only one of fairseq's ``--encoder-normalize-before`` / ``--decoder-normalize-before``
(fairseq's own mixed model, kept as fairseq builds it) one stack is PreNorm.
"""
from fairseq_normplug.models.placements.base import Placement, flag, register_placement


@register_placement("post")
class PostNorm(Placement):
    label = "postnorm"
    stock_model = stock_forward = True
    residual_stream = "normalized"
    pure_postnorm = True

    def __init__(self, args):
        super().__init__(args)
        self.prenorm_stacks = [flag(name) for name in ("encoder_normalize_before", "decoder_normalize_before")
                               if getattr(args, name, False)]
        if self.prenorm_stacks:  # fairseq's mixed model: one stack is PreNorm
            self.pure_postnorm, self.residual_stream = False, None

    def describe(self):
        if self.prenorm_stacks:
            return f"{self.prenorm_stacks[0]} (fairseq's PreNorm in one stack)"
        return super().describe()
