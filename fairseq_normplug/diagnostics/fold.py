"""``scripts/convert_norms.sh CKPT DATA OUT --to folded``: a TaperNorm model whose gate is 0
(``modules/taper_norm.py``) written as a checkpoint whose tapered norms are folded into the
linear layers they feed.

At g = 0 each tapered norm is the fixed map ``A(x) = a * x + b`` (a = gamma s, b = beta), and
a linear layer after it computes ``W A(x) + c = (W diag(a)) x + (W b + c)``: an exact rewrite
of its weight and bias (computed in float64). With PreNorm every tapered norm feeds only
linear layers:

- a layer's self-attention norm -> that layer's q, k and v projections;
- a decoder layer's cross-attention norm -> its cross-attention q projection;
- a layer's FFN norm -> its fc1;
- the encoder's final norm -> every decoder layer's cross-attention k and v projections.

The decoder's final norm was never tapered (the paper keeps the output norm as the scale
anchor, ``taper_norm.py``) and stays: a TaperNorm with ``tapers=False``, exactly LayerNorm. Every other norm slot of OUT holds a
parameter-free placeholder (``IdentityNorm``: output = input, no parameters, no buffers, no
statistics), because fairseq's layer calls its norm attributes; the stored configuration says
``taper_folded``, which builds them. A checkpoint whose gate is not 0 yet, a placement other
than PreNorm (PostNorm puts a norm's output into the residual stream, where no linear layer can
absorb it) and modifiers that change what the norms feed are refused in one line.
"""
import copy
from typing import Dict, List, Tuple

import torch

from fairseq_normplug.diagnostics.convert import converted_state, save_checkpoint
from fairseq_normplug.diagnostics.loading import DEFAULT_GENERATION, dev_translations, load_checkpoint, resolve_data
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms, norm_slots
from fairseq_normplug.models.placements.base import PRENORM_LIKE, lacks, missing_capability
from fairseq_normplug.models.resolved_config import built_config
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.taper_norm import TaperNorm

#: the plugin's switches that change what a PreNorm norm feeds, so the fold would not be exact
UNFOLDABLE_SWITCHES = ("qknorm", "normformer", "layernorm-scaling")


def fold_affine_into_linear(linear: torch.nn.Linear, scale: torch.Tensor, shift: torch.Tensor,
                            centred: bool = False) -> None:
    """Make ``linear(x)`` compute what ``linear(scale * x + shift)`` computed: W <- W diag(scale),
    bias <- bias + W shift (float64 arithmetic, stored in the layer's dtype). ``centred``: the
    map reads ``x - mean(x)`` instead of x (a fixed-std LayerNorm), folded as W <- W - rowmean(W)."""
    with torch.no_grad():
        weight = linear.weight.double()
        bias = weight @ shift.double()
        if linear.bias is not None:
            bias = bias + linear.bias.double()
        else:
            linear.bias = torch.nn.Parameter(torch.zeros_like(linear.weight[:, 0]))
        scaled = weight * scale.double()[None, :]
        if centred:
            scaled = scaled - scaled.mean(dim=1, keepdim=True)
        linear.bias.copy_(bias.to(linear.bias.dtype))
        linear.weight.copy_(scaled.to(linear.weight.dtype))


def norm_consumers(model) -> Dict[str, List[torch.nn.Linear]]:
    """{norm site: the linear layers its output feeds} of a PreNorm model: a layer's
    self-attention norm -> q, k, v; cross-attention norm -> its q; FFN norm -> fc1; the
    encoder's final norm -> every decoder layer's cross-attention k and v."""
    consumers = {}
    for prefix, stack in (("enc", model.encoder), ("dec", model.decoder)):
        for index, layer in enumerate(stack.layers):
            attention = layer.self_attn
            consumers[f"{prefix}{index}.attn"] = [attention.q_proj, attention.k_proj, attention.v_proj]
            consumers[f"{prefix}{index}.ffn"] = [layer.fc1]
            if getattr(layer, "encoder_attn", None) is not None:
                consumers[f"{prefix}{index}.cross"] = [layer.encoder_attn.q_proj]
    consumers["enc.final"] = [projection for layer in model.decoder.layers
                              if getattr(layer, "encoder_attn", None) is not None
                              for projection in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)]
    return consumers


def _unfoldable_stock_options(model) -> list:
    """fairseq's own options of ``model`` that change what its PreNorm norms feed (as flags)."""
    options = []
    if getattr(model.decoder, "cross_self_attention", False):
        options.append("--cross-self-attention")
    if any(getattr(stack, "layernorm_embedding", None) is not None for stack in (model.encoder, model.decoder)):
        options.append("--layernorm-embedding")
    return options


def check_foldable(model, path: str) -> None:
    """One-line refusals: not TaperNorm, not PreNorm, a modifier, or a gate that is not 0. The
    norm type, placement and switches are those the model was built from (its resolved
    configuration, ``models/resolved_config.py``), never the checkpoint's raw flags."""
    config = built_config(model)
    folded = config is not None and bool(config.norm_flag("taper_folded"))
    if config is None or config.norm_type != "tapernorm" or folded:
        what = "is folded already" if folded else \
            f"has --norm-type {config.norm_type if config is not None else 'layernorm'}"
        raise NormplugError(f"{path} {what}; --to folded takes a --norm-type tapernorm checkpoint")
    placement = config.placement_design
    if missing_capability(placement, PRENORM_LIKE) is not None:
        raise NormplugError(f"{path} has {placement.describe()}; --to folded needs pre (a norm output in the "
                            f"residual stream cannot be folded into a linear layer): {lacks(placement, PRENORM_LIKE)}")
    given = [f"--{switch}" for switch in UNFOLDABLE_SWITCHES if config.has(switch)] + _unfoldable_stock_options(model)
    if given:
        raise NormplugError(f"{path} has {given[0]}, which changes what the norms feed; "
                            f"--to folded takes plain PreNorm")
    gates = {float(norm.gate) for norm in named_norms(model).values() if isinstance(norm, TaperNorm) and norm.tapers}
    if gates != {0.0}:
        raise NormplugError(f"{path}: the TaperNorm gate is {max(gates):.4g}, not 0 yet (it reaches 0 at "
                            f"update {config.norm_flag('taper_updates')[1]}); train until then before --to folded")


def fold_model(model) -> Tuple[torch.nn.Module, Dict[str, int]]:
    """A copy of ``model`` with every TaperNorm folded into its linear layers and replaced by
    a placeholder; {norm name: how many linear layers absorbed it}."""
    folded = copy.deepcopy(model)
    consumers = norm_consumers(folded)
    absorbed = {}
    for owner, attr, _, name in list(norm_slots(folded)):
        norm = getattr(owner, attr)
        if not (isinstance(norm, TaperNorm) and norm.tapers):
            continue
        scale, shift = norm.affine_map()
        if name not in consumers:
            raise NormplugError(f"the norm {name} feeds no linear layer the fold knows")
        targets = consumers[name]
        for linear in targets:
            fold_affine_into_linear(linear, scale.detach(), shift.detach())
        setattr(owner, attr, IdentityNorm(norm.dim))
        absorbed[name] = len(targets)
    return folded, absorbed


def _set_model_cfg(state: dict, **values) -> None:
    model_cfg = state["cfg"]["model"]
    for key, value in values.items():
        if isinstance(model_cfg, dict):
            model_cfg[key] = value
        else:
            setattr(model_cfg, key, value)


def fold_checkpoint(checkpoint: str, data_dir: str, out: str, generation=None, echo=print) -> dict:
    """Fold, save OUT, reload it and check that it decodes the dev set as the input does;
    returns {"folded": {norm: linear layers}, "remaining_norms": [...], "hypotheses_equal": bool}."""
    resolve_data(data_dir)
    loaded = load_checkpoint(checkpoint, data_dir)
    check_foldable(loaded.model, checkpoint)
    folded, absorbed = fold_model(loaded.model)
    state = converted_state(loaded, folded, "tapernorm")
    _set_model_cfg(state, taper_folded=True)
    save_checkpoint(state, out)
    reloaded = load_checkpoint(out, data_dir)
    settings = {**DEFAULT_GENERATION, **(generation or {})}
    before, _ = dev_translations(loaded.model, loaded.task, loaded.bpe, settings)
    after, _ = dev_translations(reloaded.model, reloaded.task, reloaded.bpe, settings)
    remaining = sorted(name for name, norm in named_norms(reloaded.model).items() if not isinstance(norm, IdentityNorm))
    report = {"folded": absorbed, "remaining_norms": remaining,
              "hypotheses_equal": before == after, "sentences": len(before)}
    echo(f"[convert] folded {len(absorbed)} TaperNorms into {sum(absorbed.values())} linear layers; "
         f"remaining norm(s): {', '.join(remaining) or 'none'}; dev hypotheses "
         f"{'identical' if before == after else 'DIFFER'} ({len(before)} sentences); wrote {out}")
    if before != after:
        raise NormplugError(f"the folded model decodes differently from {checkpoint}; {out} is not exact")
    return report
