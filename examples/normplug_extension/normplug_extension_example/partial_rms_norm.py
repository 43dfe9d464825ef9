"""Partial RMSNorm (pRMSNorm) of Zhang & Sennrich (2019), "Root Mean Square Layer
Normalization", NeurIPS, section 4 ("pRMSNorm"), eq. (4)-(5) with the RMS of eq. (6)
estimated from the first k = floor(n * p) of the n channels only:

    pRMS(x) = sqrt(1/k * sum_{i <= k} x_i^2),    y = g * x / (pRMS(x) + eps)

as in the authors' code (bzhangGo/rmsnorm, ``rmsnorm_torch.py``: ``partial_size = int(d * p)``,
eps = 1e-8 added to the RMS, outside the square root). The paper's setting is p = 6.25 %.

Written only against the plugin's public interface: ``register_norm`` and ``FormulaNorm``
(fp16/bf16 computed in float32, the gain ``1 + gamma`` of ``--zero-centered-gamma``) and
``number_flag`` (``--prms-p`` finite and in (0, 1], refused in one line otherwise).
"""

from fairseq_normplug import FormulaNorm, NormplugError, number_flag, register_norm

PAPER_P = 0.0625  # 6.25 %, the paper's pRMSNorm setting
AUTHORS_EPS = 1e-8  # bzhangGo/rmsnorm's default


@register_norm("prmsnorm", per_channel_gain=True)
class PartialRMSNorm(FormulaNorm):
    """pRMSNorm: y = g * x / (sqrt(mean of x_i^2 over the first floor(n p) channels) + eps)."""

    @staticmethod
    def add_args(parser):
        parser.add_argument("--prms-p", metavar="P", **number_flag(above=0, at_most=1),
                            help=f"pRMSNorm: the share of channels the RMS is estimated from, in (0, 1] "
                                 f"(default {PAPER_P}, the paper's 6.25%%)")

    def __init__(self, dim, args):
        super().__init__(dim, zero_centered_gamma=args.zero_centered_gamma)
        p = PAPER_P if args.prms_p is None else args.prms_p
        self.partial = int(dim * p)
        if self.partial < 1:
            raise NormplugError(f"--prms-p {p} keeps no channel of a {dim}-wide norm; choose p >= {1 / dim:.4g}")
        self.eps = AUTHORS_EPS
        self.weight = self.new_gain()

    def formula(self, x, weight):
        # the l2 norm, as the authors' code: its gradient at an all-zero row (fairseq's padding
        # positions) is 0, where sqrt(mean(x^2)) would give 0/0 = NaN
        rms = x[..., :self.partial].norm(2, dim=-1, keepdim=True) * self.partial ** -0.5
        return weight * x / (rms + self.eps)

    def extra_repr(self):
        return f"{super().extra_repr()}, partial={self.partial}"
