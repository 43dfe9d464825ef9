"""nGPT (Loshchilov, Hsieh, Sun & Ginsburg, ICLR 2025, "nGPT: Normalized Transformer with
Representation Learning on the Hypersphere", arXiv:2410.01131; code: NVIDIA/ngpt, ``model.py``
and ``train.py``), for fairseq's encoder-decoder (``--ngpt``). Every hidden state and every
weight row along the model dimension d lies on the unit sphere; there is no norm layer.

Each sublayer F (self-attention, the decoder's cross-attention, the FFN) updates the state by
the normalized residual update with its eigen learning rate alpha (model.py:145-153, 169-177)::

    A = Norm(h);  B = Norm(Dropout(F(A)));  h <- Norm(A + |alpha| * (B - A))

Norm(x) = x / ||x||_2 over d, computed in float32. The parameters are stored scaled, as the
authors do (a parameter's effective value is stored * init_value / init_scaling):

* alpha_attn, alpha_cross, alpha_ffn (d,): stored 1/sqrt(d), effective 0.05 (model.py:86-92);
* sqk (d, one per attention, shared by q and k): stored 1/sqrt(d), effective 1; q and k are
  normalised per head and multiplied by sqk, the softmax scale is sqrt(d_k) (model.py:94-96,
  129-135); keys cached for incremental decoding are the normalised ones;
* suv (FFN width): stored 1, effective suv * sqrt(d), multiplies fc1's output before the
  activation (model.py:98-100, 160; fairseq's FFN and activation are kept, not SwiGLU);
* sz (vocabulary): stored 1/sqrt(d), effective 1, multiplies the logits (model.py:239-241, 284).

Linear layers have no bias (model.py:72-79, ``bias=False``). After the build, the matrices are
drawn Gaussian (model.py:259-265) and normalised along d (train.py:394-411): embeddings, the
output projection, q/k/v and fc1 per row (dim 1), out_proj and fc2 per column (dim 0). They are
normalised again after every optimizer step (train.py:499-500) by :func:`normalize_matrices`,
which ``translation_normplug``'s ``optimizer_step`` (fairseq's own hook, right after the step)
calls; rows of zeros (the padding embedding) stay zero. With ``--norm-stats-interval`` the
training log gets the authors' logged quantities instead of norm statistics (:class:`SphereStats`).

This project's choices (docs/beyond.md): the decoder's cross-attention gets the same update with
its own alpha_cross and sqk (q from the decoder state, k/v from the unit-norm encoder output);
the first layer's Norm(h) normalises fairseq's embedding sqrt(d) E[x] + sinusoidal positions
(the authors use RoPE); no final norm (the encoder output and the decoder's features are unit
vectors already, model.py:278-279).
"""
import math

import torch
import torch.nn.functional as F
from fairseq.logging import metrics
from torch import nn

from fairseq_normplug.models.placements.base import Modifier, flag, register_modifier

#: the eigen learning rates' effective initial value (``attn_alpha_init_value``, model.py:86, 90)
ALPHA_INIT = 0.05
#: the sublayers' eigen learning rates, by sublayer kind (alpha_A, alpha_C, alpha_M)
ALPHA_NAMES = {"attn": "alpha_attn", "cross": "alpha_cross", "ffn": "alpha_ffn"}
#: the attribute every nGPT matrix carries: the dimension (0 or 1) along which it is normalised
UNIT_DIM = "ngpt_unit_dim"


def unit(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x / ||x||_2 along ``dim`` in float32, returned in x's dtype (train.py:388-392); a zero
    vector stays zero."""
    x32 = x.float()
    norm = x32.norm(p=2, dim=dim, keepdim=True)
    return (x32 / torch.where(norm > 0, norm, torch.ones_like(norm))).to(x.dtype)


def scaled_parameter(size: int, stored: float, like: torch.Tensor) -> nn.Parameter:
    """A vector of ``size`` entries, all ``stored``, in ``like``'s dtype and device."""
    return nn.Parameter(torch.full((size,), stored, dtype=like.dtype, device=like.device))


class BiaslessLinear(nn.Linear):
    """A projection's weight (the same Parameter), without its bias (model.py:72-79)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight


class UnitHeadProjection(BiaslessLinear):
    """q or k: sqk * Norm(x W^T) per head (model.py:129-131); ``sqk`` is the attention's."""

    def __init__(self, linear: nn.Linear, num_heads: int, sqk: nn.Parameter):
        super().__init__(linear)
        self.num_heads = num_heads
        self.sqk = sqk
        self.sqk_factor = math.sqrt(linear.in_features)  # stored 1/sqrt(d), effective 1

    def forward(self, x):
        y = F.linear(x, self.weight)
        heads = unit(y.view(*y.shape[:-1], self.num_heads, -1)).view(y.shape)
        return heads * (self.sqk * self.sqk_factor).to(y.dtype)


class ScaledFC1(BiaslessLinear):
    """fc1 with its output times suv * sqrt(d) (model.py:160), before fairseq's activation."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.suv = scaled_parameter(linear.out_features, 1.0, linear.weight)
        self.suv_factor = math.sqrt(linear.in_features)

    def forward(self, x):
        return F.linear(x, self.weight) * (self.suv * self.suv_factor).to(x.dtype)


class ScaledLogits(BiaslessLinear):
    """The output projection (tied or not) with the logits times sz (model.py:284), plus
    ``--output-bias``'s bias when the recipe adds one (after the scaling)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.sz = scaled_parameter(linear.out_features, 1.0 / math.sqrt(linear.in_features), linear.weight)
        self.sz_factor = math.sqrt(linear.in_features)

    def forward(self, x):
        logits = F.linear(x, self.weight) * (self.sz * self.sz_factor).to(x.dtype)
        return logits if self.bias is None else logits + self.bias


def mark(weight: nn.Parameter, dim: int) -> None:
    setattr(weight, UNIT_DIM, dim)


def unit_matrices(model: nn.Module):
    """Every nGPT matrix of ``model`` (each once, tied ones too)."""
    return [p for p in model.parameters() if hasattr(p, UNIT_DIM)]


def fp32_masters(optimizer):
    """{id(model parameter): its float32 master} of fairseq's FP16Optimizer (--fp16/--bf16), the
    tensors its inner optimizer updates and then copies into the model
    (``_sync_fp32_params_to_fp16``, whose order this follows); {} for optimizers that update the
    model's parameters themselves."""
    masters = getattr(optimizer, "fp32_params", None)
    if masters is None:
        return {}
    if not optimizer.has_flat_params:
        return {id(p): master for p, master in zip(optimizer.fp16_params, masters)}
    found, offsets = {}, {}
    for p in optimizer.fp16_params:
        device = p.device.index
        offset = offsets.get(device, 0)
        found[id(p)] = masters[device].data[offset: offset + p.numel()].view_as(p)
        offsets[device] = offset + p.numel()
    return found


@torch.no_grad()
def normalize_matrices(model: nn.Module, optimizer=None) -> None:
    """Put every nGPT matrix's rows (or columns) on the unit sphere (train.py:394-408): after
    the build, and right after every optimizer step (train.py:499-500), where an optimizer with
    float32 masters has them normalised and copied into the model, so the next step, the next
    forward and a checkpoint saved now all see unit rows. The same arithmetic on every
    data-parallel rank (identical weights stay identical); no-op for other models."""
    matrices = unit_matrices(model)
    masters = fp32_masters(optimizer) if matrices else {}
    for weight in matrices:
        dim = getattr(weight, UNIT_DIM)
        master = masters.get(id(weight))
        if master is not None:
            master.copy_(unit(master, dim))
        weight.copy_(unit(weight, dim) if master is None else master)


class SphereStats(nn.Module):
    """``--norm-stats-interval N`` for nGPT, which has no norm module: every N training updates,
    the mean effective eigen learning rates and scales of one stack, as the authors log them
    (signed means, train.py:329-355), into the training log under ``ngpt_alpha:enc0.attn``
    (not DyT's ``alpha:``), ``sqk:dec1.cross``, ``suv:enc0.ffn`` and ``sz:dec``. No parameters,
    no state: the model's ``set_num_updates`` reaches it (fairseq passes it to every
    submodule), and the stack's forward pre-hook :func:`log_sphere_stats` logs."""

    def __init__(self, prefix: str, interval: int):
        super().__init__()
        self.prefix, self.interval, self.due = prefix, interval, False

    def set_num_updates(self, num_updates: int) -> None:
        self.due = self.interval > 0 and num_updates % self.interval == 0


def log_sphere_stats(stack: nn.Module, inputs) -> None:
    """A stack's forward pre-hook: log its :class:`SphereStats` on a due training update."""
    stats = stack.sphere_stats
    if not (stats.due and stack.training):
        return
    root_d = math.sqrt(stack.embed_tokens.embedding_dim)  # stored 1/sqrt(d) -> effective

    def log_mean(key: str, stored: torch.Tensor, factor: float) -> None:
        metrics.log_scalar(key, float(stored.detach().mean()) * factor, round=4)

    for index, layer in enumerate(stack.layers):
        name = f"{stats.prefix}{index}"
        for kind, attn_name in (("attn", "self_attn"), ("cross", "encoder_attn")):
            if getattr(layer, attn_name, None) is not None:
                log_mean(f"ngpt_alpha:{name}.{kind}", getattr(layer, ALPHA_NAMES[kind]), ALPHA_INIT * root_d)
                log_mean(f"sqk:{name}.{kind}", getattr(layer, attn_name).q_proj.sqk, root_d)
        log_mean(f"ngpt_alpha:{name}.ffn", layer.alpha_ffn, ALPHA_INIT * root_d)
        log_mean(f"suv:{name}.ffn", layer.fc1.suv, 1.0)
    if getattr(stack, "output_projection", None) is not None:
        log_mean(f"sz:{stats.prefix}", stack.output_projection.sz, root_d)


#: flags whose formulas contradict nGPT: (dest, why), refused when given (truthy)
CONTRADICTIONS = (
    ("fixnorm", "nGPT normalises every embedding row itself"),
    ("qknorm", "nGPT normalises q and k itself (with sqk)"),
    ("zero_centered_gamma", "nGPT has no norm layers"),
    ("layernorm_embedding", "nGPT has no norm layers"),
    ("adaptive_softmax_cutoff", "nGPT's logits are sz times the cosines of one output matrix"),
    ("norm_weight_decay", "nGPT has no norm layers and no weight decay"),
    ("quant_noise_pq", "nGPT replaces the projections that quant-noise hooks into"),
)


@register_modifier("ngpt")
class NGPT(Modifier):
    """nGPT on every encoder and decoder layer (module docstring); the layers run its own
    wiring (:meth:`sublayers`), replacing PostNorm's, whose norms it removes."""

    sublayer_forward = True
    #: nGPT replaces fairseq's PostNorm layers (it removes their norms), as they are built
    requires = {"stock_model": True, "pure_postnorm": True}
    training_task = "translation_normplug"  # its optimizer_step renormalises the weights

    @classmethod
    def add_args(cls, parser):
        parser.add_argument(
            "--ngpt", action="store_true",
            help="nGPT (Loshchilov et al. 2025): hidden states and weight rows on the unit sphere, "
                 "eigen learning rates, no norm layers, weights renormalised after every step "
                 "(needs --task translation_normplug, no weight decay)")

    def __init__(self, args, placement):
        super().__init__(args, placement)
        self.stats_interval = args.norm_stats_interval
        if args.norm_type != "layernorm":
            self.refuse(f"--ngpt cannot be combined with --norm-type {args.norm_type}: nGPT has no norm layers")
        if getattr(args, "weight_init", None) not in (None, "fairseq") or getattr(args, "smallinit", False):
            self.refuse(f"--ngpt cannot be combined with --weight-init {args.weight_init or 'smallinit'}: nGPT "
                        f"draws Gaussian matrices and normalises them")
        if getattr(args, "embed_scale", None) == "learnable":
            self.refuse("--ngpt cannot be combined with --embed-scale learnable: the first layer normalises "
                        "the embedding, so its scale has no effect")
        if getattr(args, "residual_scale", None) not in (None, "none"):
            self.refuse(f"--ngpt cannot be combined with --residual-scale {args.residual_scale}: nGPT's "
                        f"residual update has its own eigen learning rates")
        for dest, why in CONTRADICTIONS:
            if getattr(args, dest, None):
                self.refuse(f"--ngpt cannot be combined with {flag(dest)}: {why}")
        if getattr(args, "ddp_backend", None) == "fully_sharded":
            self.refuse("--ngpt cannot be combined with --ddp-backend fully_sharded: FSDP flattens the matrices "
                        "that nGPT renormalises row by row after every step")
        if getattr(args, "weight_decay", 0) > 0:
            self.refuse(f"--ngpt trains without weight decay (NVIDIA/ngpt train.py:113): drop --weight-decay "
                        f"{args.weight_decay}")
        self.refuse_other_task(args, "its optimizer_step renormalises the weights after every step")
        self.refuse_xformers(args, "xFormers attention reads the q/k/v weights and would skip the q/k norms")

    def refusal(self, placement):
        return (f"--ngpt cannot be combined with {placement.describe()}: nGPT replaces the residual placement "
                f"and has no norm layers")

    def build_layer(self, layer, index, num_layers):
        d = layer.embed_dim
        for kind, attn_name, norm_name in (("attn", "self_attn", "self_attn_layer_norm"),
                                           ("cross", "encoder_attn", "encoder_attn_layer_norm")):
            attn = getattr(layer, attn_name, None)
            if attn is None:
                continue
            sqk = scaled_parameter(d, 1.0 / math.sqrt(d), attn.q_proj.weight)
            attn.q_proj = UnitHeadProjection(attn.q_proj, attn.num_heads, sqk)
            attn.k_proj = UnitHeadProjection(attn.k_proj, attn.num_heads, sqk)
            attn.v_proj, attn.out_proj = BiaslessLinear(attn.v_proj), BiaslessLinear(attn.out_proj)
            attn.scaling = attn.head_dim ** 0.5  # the softmax scale sqrt(d_k), model.py:135
            attn._set_skip_embed_dim_check()  # fairseq's fast paths would read the weights directly
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                mark(proj.weight, 1)
            mark(attn.out_proj.weight, 0)
            setattr(layer, norm_name, None)
            setattr(layer, ALPHA_NAMES[kind], scaled_parameter(d, 1.0 / math.sqrt(d), sqk))
        layer.fc1, layer.fc2 = ScaledFC1(layer.fc1), BiaslessLinear(layer.fc2)
        mark(layer.fc1.weight, 1)
        mark(layer.fc2.weight, 0)
        layer.final_layer_norm = None
        layer.alpha_ffn = scaled_parameter(d, 1.0 / math.sqrt(d), layer.fc1.weight)
        layer.placement = self  # the layer runs nGPT's wiring (sublayers below)

    def build_stack(self, stack):
        mark(stack.embed_tokens.weight, 1)
        decoder = getattr(stack, "output_projection", None) is not None
        if decoder:
            stack.output_projection = ScaledLogits(stack.output_projection)
            mark(stack.output_projection.weight, 1)
        stack.sphere_stats = SphereStats("dec" if decoder else "enc", self.stats_interval)
        stack.register_forward_pre_hook(log_sphere_stats)

    def finish_model(self, model):
        """The authors' init: Gaussian matrices (model.py:259-265; fairseq draws the embeddings
        so already, with a zero padding row), normalised (train.py:410-411): uniform directions."""
        embeddings = {id(model.encoder.embed_tokens.weight), id(model.decoder.embed_tokens.weight)}
        with torch.no_grad():
            for weight in unit_matrices(model):
                if id(weight) not in embeddings:
                    weight.normal_()
        normalize_matrices(model)

    @staticmethod
    def alpha(layer, kind: str) -> torch.Tensor:
        """|alpha| of sublayer ``kind``, effective value (stored * 0.05 * sqrt(d), model.py:145-146)."""
        stored = getattr(layer, ALPHA_NAMES[kind])
        return (stored.float() * (ALPHA_INIT * math.sqrt(stored.numel()))).abs()

    def sublayers(self, layer, x, sublayers):
        """h <- Norm(A + |alpha| (Norm(Dropout(F(A))) - A)), A = Norm(h), per sublayer, in float32."""
        h = unit(x).float()
        for kind, sublayer in sublayers:
            branch = unit(layer.dropout_module(sublayer(h.to(x.dtype)))).float()
            h = unit(h + self.alpha(layer, kind) * (branch - h))
        return h.to(x.dtype)
