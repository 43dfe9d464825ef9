"""DenseFormer (Pagliardini, Mohtashami, Fleuret & Jaggi, "DenseFormer: Enhancing Information Flow
in Transformers via Depth Weighted Averaging", NeurIPS 2024, arXiv:2402.02622; authors' code
epfml/DenseFormer at c99a623, ``denseformer/denseformer.py``): after block i of a stack of N,
a depth-weighted average (DWA) of the embedding output X_0 and every block output so far,

    Y_i = sum_{j=0..i+1} alpha_{i,j} X_j,     X_{i+1} = B_i(Y_{i-1})   (Y_{-1} = X_0),

Y_i the input of block i+1 (Y_{N-1}: the stack's output, before its final norm), X_j the raw
output of block j-1 (not its average). The weights of block i are ``alpha_i`` (i+2 of them),
initialised to the identity: alpha_{i,i+1} = 1, the others 0, so the model starts as the plain
one (``DWAModules._init_weights``, ``denseformer.py:39-43``; the average itself is
``torch.tensordot(alphas[i].weight.view(-1), accumulators[:i+2], dims=1)``, line 63, over the
embedding output set at line 52 and each block output appended at lines 57-61). The authors'
dilated and periodic k x p variants (``DWAModules(n_blocks, dilation, period)``, lines 30-35,
47-63): ``--denseformer-dilation K`` averages after block i only the X_j with j = i+1 (mod K)
((i+1)//K + 1 weights), ``--denseformer-period P`` averages only after the blocks with
(i+1) % P == 0 (the others pass their output on); both default to 1, the plain DenseFormer.

Here each stack (encoder and decoder) has its own DWA: ``denseformer.alphas`` of the stack, its
X_0 the input of the first layer (fairseq's embedding output after scaling, positions, dropout
and ``--layernorm-embedding``). The averages are computed by a forward hook on each layer, outside
the layer (and outside fairseq's ``--checkpoint-activations`` wrapper), as a plain sum
sum_j alpha_{i,j} X_j that keeps references to the block outputs rather than stacking copies. The
authors' model is decoder-only; the encoder gets the same formula, and the decoder's
cross-attention reads the encoder's output (its last average, then its final norm). The average
mixes the same position across depth only, so in incremental decoding the new position's
average needs only its own block outputs of this step: no cache.

Refused: placements whose layers pass several residual streams concatenated
(``resi-dual``, ``siamese``, ``hyper-connections``, ``attention-residuals``: the block outputs
are not one d-wide stream to average), ``--ngpt`` (its hidden states live on the unit sphere, which an average leaves) and
LayerDrop (a skipped block has no output to average). Channels that a modifier appends to the
stream beyond its d (``--value-residual`` carries the first layer's values V_1 so) pass on unaveraged.
"""
import functools
from typing import List, Optional

import torch
from torch import Tensor, nn

from fairseq_normplug.numeric_flags import number_flag

from fairseq_normplug.models.placements.base import Modifier, flag, register_modifier



class DepthWeightedAverages(nn.Module):
    """The DWA weights of one stack of ``num_layers`` blocks with dilation k and period p:
    ``alphas["i"]`` (for the blocks i with (i+1) % p == 0) mixes the X_j with j = i+1 (mod k),
    j <= i+1 ((i+1)//k + 1 weights; k = 1: all of X_0..X_{i+1}); identity init. ``history`` holds
    X_0..X_{i+1} during one forward."""

    def __init__(self, num_layers: int, dilation: int = 1, period: int = 1):
        super().__init__()
        self.num_layers, self.dilation, self.period = num_layers, dilation, period
        alphas = {}
        for index in range(num_layers):
            if (index + 1) % period == 0:
                alpha = torch.zeros((index + 1 + dilation) // dilation)
                alpha[-1] = 1.0  # the block's own output: the plain Transformer
                alphas[str(index)] = nn.Parameter(alpha)
        self.alphas = nn.ParameterDict(alphas)
        self.history: Optional[List[Tensor]] = None

    def forward(self, index: int, history: List[Tensor]) -> Tensor:
        """Y_index from history = X_0..X_{index+1}: sum_m alphas[index][m] X_{(index+1) % k + m k}
        after an averaging block, X_{index+1} after the others."""
        if str(index) not in self.alphas:
            return history[-1]
        alpha = self.alphas[str(index)].to(history[-1].dtype)
        outputs = history[(index + 1) % self.dilation::self.dilation]
        average = alpha[0] * outputs[0]
        for weight, output in zip(alpha[1:], outputs[1:]):
            average = average + weight * output
        return average

    def extra_repr(self) -> str:
        return f"blocks={self.num_layers}, dilation={self.dilation}, period={self.period}"


def average_after_block(averages: DepthWeightedAverages, index: int, layer: nn.Module, args, kwargs, output):
    """Forward hook of block ``index``: record its output X_{index+1} (and, at block 0, its input
    X_0), return the layer's output with Y_index in place of X_{index+1}."""
    x = output[0] if isinstance(output, tuple) else output
    if index == 0:
        averages.history = [args[0] if args else kwargs["x"]]
    history = averages.history
    if history is None or len(history) != index + 1:
        raise RuntimeError(f"--denseformer: block {index} ran without the blocks before it in this forward")
    width = history[0].shape[-1]
    if x.shape[:-1] != history[0].shape[:-1] or x.shape[-1] < width:
        raise RuntimeError(f"--denseformer: block {index} returned shape {tuple(x.shape)}, its stack's embedding "
                           f"output has {tuple(history[0].shape)}; DWA averages one d-wide stream")
    # channels beyond d are side channels a modifier carries from layer to layer (--value-residual's
    # V_1): they pass on unaveraged
    stream, side = x[..., :width], x[..., width:]
    history.append(stream)
    average = averages(index, history)
    if side.shape[-1]:
        average = torch.cat([average, side], dim=-1)
    if index == averages.num_layers - 1:
        averages.history = None  # nothing kept between forwards
    return (average, *output[1:]) if isinstance(output, tuple) else average


@register_modifier("denseformer")
class DenseFormer(Modifier):
    """A depth-weighted average of all earlier block outputs after every block (module docstring)."""

    defaults = {"denseformer_dilation": None, "denseformer_period": None}
    #: DWA averages the blocks' d-wide outputs
    requires = {"single_stream": True}

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--denseformer", action="store_true",
            help="DenseFormer (Pagliardini et al. 2024): after each block, a learned weighted average of the "
                 "embedding output and all block outputs so far (identity init), in the encoder and the "
                 "decoder; every norm type; not with resi-dual, siamese, hyper-connections, attention-residuals, "
                 "--ngpt, LayerDrop")
        parser.add_argument(
            "--denseformer-dilation", metavar="K", **number_flag(int, at_least=1, note="the DWA dilation"),
            help="--denseformer: average only the outputs X_j with j = i+1 (mod K) after block i "
                 "(default 1: all of them; the authors' k)")
        parser.add_argument(
            "--denseformer-period", metavar="P", **number_flag(int, at_least=1, note="the DWA period"),
            help="--denseformer: average only after the blocks i with (i+1) %% P == 0 (default 1: every "
                 "block; the authors' p)")

    def refusal(self, placement):
        return (f"--denseformer cannot be combined with {placement.describe()}: its layers pass several residual "
                f"streams concatenated, not one d-wide stream to average")

    def __init__(self, args, placement):
        super().__init__(args, placement)
        if getattr(args, "ngpt", False):
            self.refuse("--denseformer cannot be combined with --ngpt: nGPT's hidden states live on the unit "
                        "sphere, which a weighted average leaves")
        for name in ("encoder_layerdrop", "decoder_layerdrop"):
            if getattr(args, name, 0):
                self.refuse(f"{flag(name)} {getattr(args, name)} cannot be combined with --denseformer: a skipped "
                            f"block has no output to average")
        for name in ("encoder_layers_to_keep", "decoder_layers_to_keep"):
            if getattr(args, name, None):
                self.refuse(f"{flag(name)} cannot be combined with --denseformer: each block's averaging weights "
                            f"are defined over all blocks of its stack")
        self.dilation = args.denseformer_dilation or 1
        self.period = args.denseformer_period or 1

    def resolved_fields(self):
        return {"denseformer_dilation": self.dilation, "denseformer_period": self.period}

    def build_stack(self, stack):
        stack.denseformer = DepthWeightedAverages(len(stack.layers), self.dilation, self.period)
        for index, layer in enumerate(stack.layers):
            layer.register_forward_hook(functools.partial(average_after_block, stack.denseformer, index),
                                        with_kwargs=True)
