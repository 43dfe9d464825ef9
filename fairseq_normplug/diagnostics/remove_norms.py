"""``scripts/convert_norms.sh CKPT DATA OUT --to none``: every LayerNorm of a trained model
removed by fine-tuning (Heimersheim 2024, "You can remove GPT2's LayerNorm by fine-tuning",
arXiv 2409.13710; code ApolloResearch/gpt2_noLN), then folded away where it can be.

1. **Average std.** Per norm site, ``c`` = the mean over the real (non-padding) tokens of a
   calibration sample of DATA's training set of the per-token std of the norm's input,
   ``sqrt(var(x) + eps)`` (the authors' per-site constants, ``std_dicts.py``).
2. **Naive removal** (reported, not saved): every norm's std replaced by its ``c`` at once, no
   training (``modules/fixed_std_layer_norm.py``: ``gamma (x - mean x) / c + beta``).
3. **Fine-tuned removal**: the model with every norm a ``layernorm-fixed-std`` norm still
   computing its real std, each switched to its ``c`` after its own update of a short fine-tune
   (fairseq-train's loop, ``diagnostics/finetune.py``; the switch through fairseq's
   ``set_num_updates`` hook). Order (:func:`removal_order`), as the authors' ``train.py:259-310``
   (all MLP norms ``ln_2`` first, then the attention norms ``ln_1``, then ``ln_f``): the FFN
   norms in forward order, then the other sublayer norms (self-attention, cross-attention, ...)
   in forward order, then the stack norms (final, embedding). The first removal after
   ``--removal-start`` updates (default one gap), then one every ``--removal-every`` K updates
   (default 10; the authors: 200, then 20 per norm at 0.5M tokens an update), and the
   fine-tune continues :data:`TAIL_GAPS` gaps after the last (the authors' 120 updates after
   ``ln_f``: ``n_eot = n_lnf + 20``, ``n_bos = n_eot + 100``) unless ``--finetune-updates``.
4. **Folding** (:func:`fold`, PreNorm only): each fixed-std norm whose output feeds only linear
   layers becomes the identity, ``W (gamma (x - mean x)/c + beta) + b = W' x + b'`` with
   ``W' = M - rowmean(M)``, ``M = W diag(gamma / c)``, ``b' = b + W beta``: the sublayer norms
   into q/k/v, the cross-attention query and fc1, the encoder's final norm into every decoder
   layer's cross-attention k/v. The decoder's final norm stays a fixed affine map (its output
   feeds the output projection, tied to the embeddings and without a bias, as the authors'
   ``ln_f`` keeps its gamma/beta in their released model). With PostNorm (or any other
   placement) each norm's output is the residual stream: nothing is folded, every norm stays
   the fixed affine map ``gamma (x - mean x)/c + beta`` (no per-token statistic left).

OUT is an ordinary checkpoint (``--norm-type layernorm-fixed-std``, with ``--fixed-std-folded``
when folded). The report (``<OUT>.report.json/.md``) gives dev loss and BLEU before, after the
naive removal and after the fine-tuned removal (OUT as fairseq loads it), with every site's
``c``, its removal update and whether it was folded.
"""
import copy
import time
from typing import Dict, List, Optional

import torch
from torch import nn

from fairseq_normplug.diagnostics import convert
from fairseq_normplug.diagnostics.fold import fold_affine_into_linear, norm_consumers
from fairseq_normplug.diagnostics.loading import (
    DEFAULT_GENERATION, LoadedCheckpoint, batches, collect_norm_activations, load_checkpoint,
)
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.modules.fixed_std_layer_norm import FixedStdLayerNorm, is_folded_site
from fairseq_normplug.modules.identity_norm import IdentityNorm
from fairseq_normplug.modules.norm_base import effective_gain

NORM_TYPE = "layernorm-fixed-std"
#: default updates between two removals
DEFAULT_REMOVAL_EVERY = 10
#: the fine-tune runs this many gaps after the last removal (the authors: 120 updates = 6 x 20)
TAIL_GAPS = 6
#: a folded model must give the unfolded model's logits to this, relative to their largest
#: magnitude (a folding error is of order 1; the float32 rounding of folded weights ~1e-6)
FOLD_TOLERANCE = 1e-4


def average_stds(loaded: LoadedCheckpoint, samples: List[dict]) -> Dict[str, float]:
    """{site: c}: the mean per-token std ``sqrt(var(x) + eps)`` of each norm's input over the
    real tokens of ``samples`` (step 1 of the module docstring)."""
    return {name: float((x.double().var(-1, unbiased=False) + norm.eps).sqrt().mean())
            for name, (norm, x, _) in collect_norm_activations(loaded, samples).items()}


def removal_order(sites_in_forward_order: List[str]) -> List[str]:
    """FFN norms, then the other sublayer norms, then the stack norms (module docstring)."""
    def group(site):
        stack, _, short = site.partition(".")
        return 2 if not stack[3:].isdigit() else 0 if short == "ffn" else 1
    return sorted(sites_in_forward_order, key=lambda site: (group(site), sites_in_forward_order.index(site)))


def removal_schedule(order: List[str], start: int, every: int) -> Dict[str, int]:
    """{site: the update after which it uses its fixed std}: ``start``, ``start + every``, ..."""
    return {site: start + index * every for index, site in enumerate(order)}


def fixed_std_model(model, stds: Dict[str, float], schedule: Optional[Dict[str, int]] = None):
    """A copy of ``model`` whose every LayerNorm is a :class:`FixedStdLayerNorm` with its
    gamma, beta and ``c = stds[site]``; removed now, or after ``schedule[site]`` updates."""
    return convert.replace_norms(model, lambda name, norm: FixedStdLayerNorm.from_layer_norm(
        norm, effective_gain(norm), stds[name], 0 if schedule is None else schedule[name]))


def foldable(model) -> Optional[str]:
    """None when :func:`fold` applies to ``model`` (fairseq's own PreNorm layers, plain linear
    consumers with biases), else the reason it does not."""
    layers = list(model.encoder.layers) + list(model.decoder.layers)
    if not all(getattr(layer, "normalize_before", False) and type(layer).__module__.startswith("fairseq.")
               for layer in layers) or getattr(model.encoder, "layer_norm", None) is None:
        return "not PreNorm: each norm's output is the residual stream"
    for norm, consumers in norm_consumers(model).items():
        if not all(type(linear) is nn.Linear and linear.bias is not None for linear in consumers):
            return f"{norm} feeds a layer that is not a linear layer with a bias"
    return None


def fold(model):
    """A copy of the fixed-std PreNorm ``model`` whose norms at the folded sites
    (``fixed_std_layer_norm.is_folded_site``) are identities, their maps folded into the linear
    layers they feed; the other norms stay fixed affine maps."""
    folded = copy.deepcopy(model)
    norms = named_norms(folded)
    for name, consumers in norm_consumers(folded).items():
        assert is_folded_site(name) and norms[name].uses_fixed_std, name
        norm = norms[name]  # gamma (x - mean x) / c + beta: module docstring, step 4
        for linear in consumers:
            fold_affine_into_linear(linear, norm.weight.detach() / norm.fixed_std, norm.bias.detach(), centred=True)
    return convert.replace_norms(folded, lambda name, norm: IdentityNorm(norm.dim) if is_folded_site(name) else norm)


def relative_output_difference(model_a, model_b, samples: List[dict]) -> float:
    """The largest absolute difference of the two models' output logits on ``samples`` over
    the largest logit magnitude, computed in float64 (on copies): the models' difference, not
    float32 rounding of the forward pass."""
    model_a, model_b = (copy.deepcopy(model).double().eval() for model in (model_a, model_b))
    with torch.no_grad():
        outputs = [(model_a(**sample["net_input"])[0], model_b(**sample["net_input"])[0]) for sample in samples]
    return max(float((a - b).abs().max() / a.abs().max().clamp(min=1e-12)) for a, b in outputs)


def schedule_state(loaded: LoadedCheckpoint, model) -> dict:
    """The checkpoint the fine-tune starts from: its update count set to 0, so that fairseq's
    ``set_num_updates`` at load (the trainer passes the stored count) switches no norm early."""
    state = convert.converted_state(loaded, model, NORM_TYPE)
    state["optimizer_history"] = [dict(entry, num_updates=0) for entry in state.get("optimizer_history", [])]
    return state


def render_markdown(report: dict) -> str:
    lines = [f"# Removal of the LayerNorms of {convert.shown_path(report['checkpoint'])} (--to none)", "",
             f"Dev set of {convert.shown_path(report['data'])}; average stds on {report['calibration_tokens']} training "
             f"tokens; fine-tune {report['finetune']['updates']} updates (lr {report['finetune']['lr']:g}), "
             f"first removal after {report['finetune']['removal_start']}, then one every "
             f"{report['finetune']['removal_every']}; dev BLEU tokenized, beam {report['generation']['beam']}.",
             "", *convert.stage_table(report["stages"]), "",
             f"Folded: {'yes' if report['folded'] else 'no (' + report['not_folded_reason'] + ')'}.", "",
             "| norm | average std c | removed after update | in OUT |", "| --- | ---: | ---: | --- |"]
    for site, c in report["stds"].items():
        kept = "folded" if site in report["folded_sites"] else "fixed affine map"
        lines.append(f"| {site} | {c:.4g} | {report['schedule'][site]} | {kept} |")
    return "\n".join(lines) + "\n"


def remove(checkpoint: str, data_dir: str, out: str, finetune_updates: int = 0, finetune_lr: float = 1e-4,
           calibration_tokens: int = convert.DEFAULT_CALIBRATION_TOKENS, removal_every: Optional[int] = None,
           removal_start: Optional[int] = None, generation: Optional[dict] = None, echo=print,
           control: bool = False) -> dict:
    """Remove, fine-tune, fold, evaluate and report (the module docstring); returns the report.
    ``control``: also the LayerNorm model fine-tuned alike (``convert.control_stage``)."""
    removal_every = DEFAULT_REMOVAL_EVERY if removal_every is None else removal_every
    removal_start = removal_every if removal_start is None else removal_start
    if removal_every < 1 or removal_start < 1 or finetune_updates < 0 or calibration_tokens <= 0:
        raise NormplugError(f"--removal-every and --removal-start must be >= 1, --finetune-updates >= 0 and "
                            f"--calibration-tokens > 0, got {removal_every}, {removal_start}, "
                            f"{finetune_updates} and {calibration_tokens}")
    started = time.time()
    loaded, sites = convert.load_layer_norm_model(checkpoint, data_dir, out)
    samples = list(batches(loaded.task, "train", convert.CALIBRATION_BATCH_TOKENS, limit_tokens=calibration_tokens))
    order = removal_order(convert.forward_order(loaded.model, samples))
    schedule = removal_schedule(order, removal_start, removal_every)
    last_removal = max(schedule.values())
    updates = finetune_updates or last_removal + TAIL_GAPS * removal_every
    if updates <= last_removal:
        raise NormplugError(f"--finetune-updates {updates} ends before the last of the {len(sites)} norms is "
                            f"removed (after update {last_removal}); pass more than {last_removal}, or a "
                            f"smaller --removal-every/--removal-start")
    generation = {**DEFAULT_GENERATION, **(generation or {})}
    evaluate = convert.stage_evaluator(loaded, generation, echo)
    stages = [evaluate(loaded.model, "before removal (LayerNorm)")]
    stds = average_stds(loaded, samples)
    stages.append(evaluate(fixed_std_model(loaded.model, stds), "naive removal (std -> its average c, no fine-tune)"))

    finetune_dir = convert.report_paths(out)[2]
    start_path = f"{finetune_dir}.start.pt"
    convert.save_checkpoint(schedule_state(loaded, fixed_std_model(loaded.model, stds, schedule)), start_path)
    echo(f"[convert] fine-tuning {updates} updates (lr {finetune_lr:g}), removing one of {len(sites)} norms "
         f"every {removal_every} updates from update {removal_start}; log: {finetune_dir}/train.log")
    finetuned_path = convert.finetune(start_path, loaded.data_bin, finetune_dir, updates, finetune_lr)
    finetuned = load_checkpoint(finetuned_path, data_dir)
    if not all(norm.uses_fixed_std for norm in named_norms(finetuned.model).values()):
        raise NormplugError(f"internal error: {finetuned_path} still computes a per-token std")

    reason = foldable(finetuned.model)
    result = finetuned.model if reason else fold(finetuned.model)
    if not reason:
        difference = relative_output_difference(finetuned.model, result, samples[:1])
        if difference > FOLD_TOLERANCE:
            raise NormplugError(f"internal error: the folded model differs from the fine-tuned one by {difference:.3g}")
    flags = {} if reason else {"fixed_std_folded": True}
    convert.save_checkpoint(convert.converted_state(finetuned, result, NORM_TYPE, **flags), out)
    stages.append(evaluate(load_checkpoint(out, data_dir).model,
                           f"fine-tuned removal ({updates} updates{'' if reason else ', folded'})"))
    if control:
        stages.append(convert.control_stage(checkpoint, data_dir, loaded, out, updates, finetune_lr, evaluate, echo))
    report = {
        "checkpoint": checkpoint, "data": data_dir, "to": "none", "out": out, "finetuned": finetuned_path,
        "calibration_tokens": calibration_tokens, "generation": generation,
        "finetune": {"updates": updates, "lr": finetune_lr, "removal_every": removal_every,
                     "removal_start": removal_start}, "control": control,
        "stages": stages, "stds": {site: stds[site] for site in order}, "schedule": schedule,
        "folded": reason is None, "not_folded_reason": reason,
        "folded_sites": [] if reason else [site for site in order if is_folded_site(site)],
        "minutes": round((time.time() - started) / 60, 2),
    }
    json_path, md_path = convert.write_report(out, report, render_markdown(report))
    echo(f"[convert] wrote {out}, {json_path}, {md_path}")
    return report
