"""``scripts/convert_norms.sh CKPT DATA OUT --to dyt|derf``: a trained LayerNorm Transformer
(``transformer_normplug`` or stock ``transformer``) converted to a norm-free one, with
calibrated parameters, and what the conversion costs.

Every LayerNorm is replaced by the target type (``--to``, :data:`fitting.TARGETS`): gamma
and beta copied, alpha fitted per norm by least squares on the real activations of a
calibration batch of DATA's training set (``fitting.fit_dyt``; Derf's shift too,
``fitting.fit_derf``; gamma refitted per channel unless ``--keep-gamma``). OUT is an ordinary checkpoint (``--arch transformer_normplug
--norm-type dyt`` in its stored configuration, no LayerNorm left) that fairseq-generate,
fairseq-train ``--restore-file`` and the hub interface load.

Dev loss (fairseq's valid_loss: the criterion's, base 2) and tokenized dev BLEU are reported
before conversion, after the naive swap (alpha = 0.5, gamma and beta copied: what swapping
modules gives; Derf: alpha 0.5, shift 0), after the calibrated conversion, and with ``--finetune-updates N`` after a
short fine-tune (``diagnostics.finetune``). The report goes to OUT's folder as
``<OUT name>.report.json`` and ``.report.md``; a calibration that does not beat the naive
swap on dev loss is reported and the command exits with status 3.
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
from omegaconf import OmegaConf, open_dict

from fairseq_normplug.cli import user_dir
from fairseq_normplug.diagnostics import fitting
from fairseq_normplug.diagnostics.loading import (
    DEFAULT_GENERATION, LoadedCheckpoint, batches, checkpoint_parser, collect_norm_activations,
    evaluate_model, load_checkpoint, resolve_data,
)
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.tables import atomic_output, write_text_atomic
from fairseq_normplug.models.norm_placement import named_norms, norm_slots

#: calibration batches hold at most this many source tokens each
CALIBRATION_BATCH_TOKENS = 1000
NOT_BETTER_EXIT_CODE = 3


def layer_norm_sites(loaded: LoadedCheckpoint) -> List[str]:
    """The norm sites to convert; a model without LayerNorm (or with mixed norms) is an error."""
    norms = named_norms(loaded.model)
    kinds = sorted({type(norm).__name__ for norm in norms.values()})
    sites = [name for name, norm in norms.items() if fitting.is_layer_norm(norm)]
    if not sites:
        raise NormplugError(f"{loaded.path} has no LayerNorm to convert (its norms: "
                            f"{', '.join(kinds) or 'none'}); convert_norms takes a LayerNorm model")
    if len(sites) != len(norms):
        raise NormplugError(f"{loaded.path} mixes norm types ({', '.join(kinds)}); "
                            f"convert_norms takes a model whose norms are all LayerNorm")
    return sites


def replace_norms(model, make) -> Dict[str, object]:
    """A copy of ``model`` whose norm at each site is ``make(site, old norm)``."""
    converted = copy.deepcopy(model)
    for owner, attr, _, name in list(norm_slots(converted)):
        setattr(owner, attr, make(name, getattr(owner, attr)))
    return converted


def converted_state(loaded: LoadedCheckpoint, model, norm_type: str) -> dict:
    """The checkpoint of ``model``: the input's, with the converted weights, the stored model
    configuration switched to ``transformer_normplug --norm-type <norm_type>`` and no
    optimizer state (it belonged to other parameters). The converted norms hold the applied
    gain (1 + gamma of a ``--zero-centered-gamma`` LayerNorm) as a stock gamma, so the stored
    configuration has ``zero_centered_gamma`` off."""
    state = {key: value for key, value in loaded.state.items() if key != "last_optimizer_state"}
    state["model"] = model.state_dict()
    cfg = copy.deepcopy(loaded.state["cfg"])
    with open_dict(cfg):
        updates = {"arch": "transformer_normplug", "_name": "transformer_normplug", "norm_type": norm_type}
        if getattr(cfg.model, "zero_centered_gamma", False):  # the gain is now a stock gamma
            updates["zero_centered_gamma"] = False
        if isinstance(cfg.model, argparse.Namespace):
            for key, value in updates.items():
                setattr(cfg.model, key, value)
        else:
            cfg.model.update(updates)
        cfg.common.user_dir = user_dir()
    state["cfg"] = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    state["last_optimizer_state"] = None
    return state


def save_checkpoint(state: dict, path: str) -> None:
    with atomic_output(path) as tmp:
        torch.save(state, tmp)


def finetune(checkpoint: str, data_bin: str, save_dir: str, updates: int, lr: float) -> str:
    """Fine-tune ``checkpoint`` for ``updates`` updates in a fresh process
    (``diagnostics.finetune``); returns the resulting checkpoint's path."""
    os.makedirs(save_dir, exist_ok=True)
    log_path = os.path.join(save_dir, "train.log")
    result = os.path.join(save_dir, "checkpoint_last.pt")
    if os.path.exists(result):  # an earlier run's: never mistaken for this one's
        os.remove(result)
    command = [sys.executable, "-m", "fairseq_normplug.diagnostics.finetune", checkpoint, data_bin,
               save_dir, "--updates", str(updates), "--lr", str(lr)]
    with open(log_path, "w", encoding="utf-8") as log:
        returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode != 0 or not os.path.isfile(result):
        raise NormplugError(f"the fine-tune failed (exit {returncode}); see {log_path}")
    return result


def _num(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(report: dict) -> str:
    """The report's tables: dev numbers per stage, then the fit of every norm site."""
    lines = [f"# Conversion of {report['checkpoint']} to {report['to']}", "",
             f"Dev set of {report['data']}; calibration on {report['calibration_tokens']} training "
             f"tokens; dev BLEU tokenized, beam {report['generation']['beam']}.", "",
             "| stage | dev loss | dev nll loss | dev BLEU |", "| --- | ---: | ---: | ---: |"]
    for stage in report["stages"]:
        lines.append(f"| {stage['stage']} | {_num(stage['loss'])} | {_num(stage['nll_loss'])} | "
                     f"{_num(stage.get('bleu'), 2)} |")
    verdict = "beats" if report["calibration_beats_naive"] else "does NOT beat"
    lines += ["", f"Calibration {verdict} the naive swap on dev loss.", "",
              "| norm | input std | 1/std | fitted alpha | gamma refitted | MSE naive | MSE calibrated | "
              "MSE / Var(LN output) |", "| --- | ---: | ---: | ---: | :---: | ---: | ---: | ---: |"]
    for name, fit in report["fits"].items():
        lines.append(f"| {name} | {fit['in_std']:.3g} | {1 / fit['in_std']:.3g} | {fit['alpha']:.3g} | "
                     f"{'yes' if fit['gamma_refitted'] else 'no'} | {fit['naive_mse']:.3g} | "
                     f"{fit['mse']:.3g} | {fit['mse'] / max(fit['out_var'], 1e-12):.3g} |")
    return "\n".join(lines) + "\n"


def report_paths(out: str):
    stem = out[:-3] if out.endswith(".pt") else out
    return f"{stem}.report.json", f"{stem}.report.md", f"{stem}.finetune"


def convert(checkpoint: str, data_dir: str, out: str, to: str = "dyt", finetune_updates: int = 0,
            finetune_lr: float = 1e-4, calibration_tokens: int = 2000, refit_gamma: bool = True,
            generation: Optional[dict] = None, echo=print) -> dict:
    """Convert, evaluate and report (the module docstring); returns the report."""
    target = fitting.target(to)
    if finetune_updates < 0 or calibration_tokens <= 0:
        raise NormplugError(f"--finetune-updates must be >= 0 and --calibration-tokens > 0, got "
                            f"{finetune_updates} and {calibration_tokens}")
    if os.path.abspath(out) == os.path.abspath(checkpoint):
        raise NormplugError(f"OUT {out} is the input checkpoint; choose another path")
    resolve_data(data_dir)
    started = time.time()
    loaded = load_checkpoint(checkpoint, data_dir)
    sites = layer_norm_sites(loaded)
    task = loaded.task
    criterion = task.build_criterion(loaded.cfg.criterion)
    generation = {**DEFAULT_GENERATION, **(generation or {})}

    def evaluate(model, stage):
        result = {"stage": stage, **evaluate_model(model, task, criterion, loaded.bpe, generation)}
        echo(f"[convert] {stage}: dev loss {result['loss']:.3f}, dev BLEU {result['bleu']:.2f}")
        return result

    stages = [evaluate(loaded.model, "before conversion (LayerNorm)")]
    samples = list(batches(task, "train", CALIBRATION_BATCH_TOKENS, limit_tokens=calibration_tokens))
    activations = collect_norm_activations(loaded, samples)
    echo(f"[convert] calibrating {len(sites)} norms on {activations[sites[0]][1].shape[0]} "
         f"encoder-side tokens of the training set")
    fits, fitted = {}, {}
    for name in sites:
        norm, x, y = activations[name]
        fitted[name], fits[name] = target.fit(norm, x, y, refit_gamma=refit_gamma)
    naive = replace_norms(loaded.model, lambda name, norm: target.naive(norm))
    naive_alpha = float(named_norms(naive)[sites[0]].alpha)
    stages.append(evaluate(naive, f"naive swap ({to}, alpha = {naive_alpha:g})"))

    calibrated = replace_norms(loaded.model, lambda name, norm: fitted[name])
    save_checkpoint(converted_state(loaded, calibrated, target.norm_type), out)
    reloaded = load_checkpoint(out, data_dir)  # what fairseq-generate will load
    left = sorted({type(norm).__name__ for norm in named_norms(reloaded.model).values()
                   if fitting.is_layer_norm(norm)})
    if left:
        raise NormplugError(f"internal error: {out} still holds {left}")
    stages.append(evaluate(reloaded.model, f"calibrated {to} (no training)"))
    json_path, md_path, finetune_dir = report_paths(out)
    finetuned = None
    if finetune_updates:
        echo(f"[convert] fine-tuning {finetune_updates} updates (lr {finetune_lr:g}); log: "
             f"{finetune_dir}/train.log")
        finetuned = finetune(out, loaded.data_bin, finetune_dir, finetune_updates, finetune_lr)
        stages.append(evaluate(load_checkpoint(finetuned, data_dir).model,
                               f"calibrated {to} + {finetune_updates}-update fine-tune"))
    naive_loss, calibrated_loss = stages[1]["loss"], stages[2]["loss"]
    report = {
        "checkpoint": checkpoint, "data": data_dir, "to": to, "out": out, "finetuned": finetuned,
        "calibration_tokens": calibration_tokens, "refit_gamma": refit_gamma, "generation": generation,
        "finetune": {"updates": finetune_updates, "lr": finetune_lr},
        "stages": stages, "calibration_beats_naive": calibrated_loss < naive_loss, "fits": fits,
        "minutes": round((time.time() - started) / 60, 2),
    }
    write_text_atomic(json_path, json.dumps(report, indent=2) + "\n")
    write_text_atomic(md_path, render_markdown(report))
    verdict = "beats" if report["calibration_beats_naive"] else "does NOT beat"
    echo(f"[convert] calibration {verdict} the naive swap on dev loss: {calibrated_loss:.3f} vs "
         f"{naive_loss:.3f}")
    echo(f"[convert] wrote {out}, {json_path}, {md_path}")
    return report


def main(argv=None) -> dict:
    parser = checkpoint_parser("convert_norms.sh", __doc__)
    parser.add_argument("out", help="output checkpoint path")
    parser.add_argument("--to", default="dyt", help=f"target norm type: {', '.join(fitting.TARGETS)} (default dyt)")
    parser.add_argument("--finetune-updates", type=int, default=0, metavar="N",
                        help="fine-tune the converted model N updates afterwards (default 0: none)")
    parser.add_argument("--finetune-lr", type=float, default=1e-4, help="its constant lr (default 1e-4)")
    parser.add_argument("--calibration-tokens", type=int, default=2000, metavar="N",
                        help="source tokens of the training set used for calibration (default 2000)")
    parser.add_argument("--keep-gamma", action="store_true",
                        help="copy gamma unchanged (default: refit it per channel when that fits better)")
    parser.add_argument("--beam", type=int, default=DEFAULT_GENERATION["beam"], help="dev BLEU beam (4)")
    parser.add_argument("--lenpen", type=float, default=DEFAULT_GENERATION["lenpen"],
                        help="dev BLEU length penalty (0.6)")
    args = parser.parse_args(argv)
    try:
        report = convert(args.checkpoint, args.data, args.out, args.to, args.finetune_updates,
                         args.finetune_lr, args.calibration_tokens, not args.keep_gamma,
                         {"beam": args.beam, "lenpen": args.lenpen})
    except NormplugError as error:
        sys.exit(f"convert_norms.sh: error: {error}")
    if not report["calibration_beats_naive"]:
        sys.exit(NOT_BETTER_EXIT_CODE)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
