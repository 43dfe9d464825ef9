"""``scripts/convert_norms.sh CKPT DATA OUT --to dyt|derf``: a trained LayerNorm Transformer
(``transformer_normplug`` or stock ``transformer``) converted to a norm-free one, with
calibrated parameters, and what the conversion costs.

Every LayerNorm is replaced by the target type (``--to``, :data:`fitting.TARGETS`), its
parameters fitted by least squares on real activations of a calibration sample of DATA's
training set (``--calibration-tokens``, default 20000 source tokens, in batches of
:data:`CALIBRATION_BATCH_TOKENS`; at most :data:`MAX_FIT_ROWS` rows per norm, a fixed-seed
subsample beyond that). Per norm, alpha (Derf: and its shift) is searched and the per-channel
gamma and beta are fitted jointly with it in closed form (``fitting.fit_dyt``,
``fitting.fit_derf``; ``--affine``: ``joint`` (default), ``gamma`` (the earlier method: beta
copied, gamma alone refitted) or ``keep`` (``--keep-gamma``: gamma and beta copied, alpha alone)).

``--calibration layerwise`` (the default) fits the norms one at a time in forward order, each
on the inputs it receives in the partially converted model, whose earlier norms are already
replaced by their fits (norm k sees the outputs of converted norms < k); the target is what
the ORIGINAL LayerNorm (its own gamma and beta) gives on that same input, so each fit is a
local function match and later norms absorb the drift of earlier ones' inputs. One
teacher-forced forward pass over the calibration sample per norm, stopped as soon as that
norm has run (:func:`calibrate`). ``--calibration per-norm`` fits every norm on the original
model's activations instead (the earlier method; one forward pass).

OUT is an ordinary checkpoint (``--arch transformer_normplug --norm-type dyt`` in its stored
configuration, no LayerNorm left) that fairseq-generate, fairseq-train ``--restore-file`` and
the hub interface load.

Dev loss (fairseq's valid_loss: the criterion's, base 2) and tokenized dev BLEU are reported
before conversion, after the naive swap (alpha = 0.5, gamma and beta copied: what swapping
modules gives; Derf: alpha 0.5, shift 0), after the calibrated conversion, and with ``--finetune-updates N`` after a
short fine-tune (``diagnostics.finetune``). The report goes to OUT's folder as
``<OUT name>.report.json`` and ``.report.md``; a calibration that does not beat the naive
swap on dev loss is reported and the command exits with status 3.

``--to none`` removes the LayerNorms by fine-tuning instead (Heimersheim 2024):
``diagnostics/remove_norms.py``.
"""
import argparse
import copy
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
from omegaconf import OmegaConf, open_dict

from fairseq_normplug.atomic_files import atomic_output
from fairseq_normplug.cli import user_dir
from fairseq_normplug.diagnostics import fitting
from fairseq_normplug.diagnostics.loading import (
    DEFAULT_GENERATION, LoadedCheckpoint, batches, checkpoint_parser, collect_norm_activations,
    evaluate_model, load_checkpoint, padding_masks, real_rows, resolve_data,
)
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.portable_paths import shown_path  # noqa: F401 (remove_norms: convert.shown_path)
from fairseq_normplug.command_start import run_command
from fairseq_normplug.models.norm_placement import named_norms, norm_slots
from fairseq_normplug.diagnostics.conversion_report import (  # noqa: F401 (convert.report_paths, ...)
    render_markdown, report_paths, stage_table, write_report,
)

#: calibration batches hold at most this many source tokens each
CALIBRATION_BATCH_TOKENS = 4000
#: default size of the calibration sample, in source tokens of the training set
DEFAULT_CALIBRATION_TOKENS = 20000
#: at most this many (token) rows per norm enter its fit; more are subsampled (fixed seed)
MAX_FIT_ROWS = 50000
#: how the norms are calibrated (module docstring)
CALIBRATIONS = ("layerwise", "per-norm")
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


def load_layer_norm_model(checkpoint: str, data_dir: str, out: str):
    """(loaded checkpoint, its LayerNorm sites), after the one-line checks of OUT and DATA."""
    if os.path.abspath(out) == os.path.abspath(checkpoint):
        raise NormplugError(f"OUT {out} is the input checkpoint; choose another path")
    resolve_data(data_dir)
    loaded = load_checkpoint(checkpoint, data_dir)
    return loaded, layer_norm_sites(loaded)


def replace_norms(model, make) -> Dict[str, object]:
    """A copy of ``model`` whose norm at each site is ``make(site, old norm)``."""
    converted = copy.deepcopy(model)
    for owner, attr, _, name in list(norm_slots(converted)):
        setattr(owner, attr, make(name, getattr(owner, attr)))
    return converted


def subsample_rows(x: torch.Tensor, y: torch.Tensor, limit: int = MAX_FIT_ROWS, seed: int = 1):
    """At most ``limit`` rows of the paired (rows, C) ``x`` and ``y``: all of them, or a
    fixed-seed random subset (the same rows of both), in their original order."""
    if x.shape[0] <= limit:
        return x, y
    keep = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:limit].sort().values
    return x[keep], y[keep]


class _StopForward(Exception):
    """Raised by a calibration hook once its norm has run: the rest of the pass is not needed."""


def forward_order(model, samples: List[dict]) -> List[str]:
    """The norm sites in the order the model runs them (a forward pass on the first sample),
    then any site that pass did not reach, in :func:`named_norms` order."""
    norms = named_norms(model)
    order: List[str] = []
    handles = [norm.register_forward_hook(
        lambda module, inputs, output, name=name: order.append(name) if name not in order else None)
        for name, norm in norms.items()]
    try:
        with torch.no_grad():
            model(**samples[0]["net_input"])
    finally:
        for handle in handles:
            handle.remove()
    return order + [name for name in norms if name not in order]


def site_activations(model, task, samples: List[dict], site: str):
    """(inputs, outputs) of the norm at ``site`` of ``model`` on ``samples``: (rows, C) float32
    matrices of the real (non-padding) positions; each forward pass stops right after that
    norm has run."""
    norm = named_norms(model)[site]
    xs, ys, current = [], [], {}

    def record(module, inputs, output):
        mask = current["masks"][site[:3]]
        xs.append(real_rows(inputs[0], mask))
        ys.append(real_rows(output, mask))
        raise _StopForward

    handle = norm.register_forward_hook(record)
    try:
        with torch.no_grad():
            for sample in samples:
                current["masks"] = padding_masks(task, sample)
                try:
                    model(**sample["net_input"])
                except _StopForward:
                    pass
    finally:
        handle.remove()
    if not xs:
        raise NormplugError(f"the norm at {site} did not run on the calibration batches")
    return torch.cat(xs), torch.cat(ys)


def calibrate(loaded: LoadedCheckpoint, samples: List[dict], target, calibration: str = "layerwise",
              affine: str = "joint", inputs: Optional[Dict[str, torch.Tensor]] = None):
    """(calibrated model, {site: fit info}): ``loaded.model`` (left unchanged) with every
    LayerNorm replaced by ``target``'s fit (``affine`` as in ``fitting.fit_squash``).
    ``calibration="layerwise"``: in forward order, norm k is fitted on its inputs in the model
    whose norms < k are already converted, against the original LayerNorm's output on those
    inputs; ``"per-norm"``: every norm on the original model's activations. ``inputs``, a
    dict, receives each site's fitted input rows (for tests)."""
    if calibration not in CALIBRATIONS:
        raise NormplugError(f"unknown --calibration {calibration!r}; choose from {', '.join(CALIBRATIONS)}")
    fits = {}
    if calibration == "per-norm":
        fitted = {}
        for name, (norm, x, y) in collect_norm_activations(loaded, samples).items():
            x, y = subsample_rows(x, y)
            fitted[name], fits[name] = target.fit(norm, x, y, affine=affine)
            if inputs is not None:
                inputs[name] = x
        return replace_norms(loaded.model, lambda name, norm: fitted[name]), fits
    model = copy.deepcopy(loaded.model).eval()
    slots = {name: (owner, attr) for owner, attr, _, name in norm_slots(model)}
    for name in forward_order(model, samples):
        owner, attr = slots[name]
        norm = getattr(owner, attr)  # still the original LayerNorm: y is LN(x) with its gamma, beta
        x, y = subsample_rows(*site_activations(model, loaded.task, samples, name))
        module, fits[name] = target.fit(norm, x, y, affine=affine)
        setattr(owner, attr, module)
        if inputs is not None:
            inputs[name] = x
    return model, {name: fits[name] for name in named_norms(model)}


def converted_state(loaded: LoadedCheckpoint, model, norm_type: str, **model_flags) -> dict:
    """The checkpoint of ``model``: the input's, with the converted weights, the stored model
    configuration switched to ``transformer_normplug --norm-type <norm_type>`` and no
    optimizer state (it belonged to other parameters). The converted norms hold the applied
    gain (1 + gamma of a ``--zero-centered-gamma`` LayerNorm) as a stock gamma, so the stored
    configuration has ``zero_centered_gamma`` off. ``model_flags`` set further model flags."""
    state = {key: value for key, value in loaded.state.items() if key != "last_optimizer_state"}
    state["model"] = model.state_dict()
    cfg = copy.deepcopy(loaded.state["cfg"])
    with open_dict(cfg):
        updates = {"arch": "transformer_normplug", "_name": "transformer_normplug", "norm_type": norm_type,
                   **model_flags}
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
        # the one seam that starts commands: the tests fork it
        returncode = run_command(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode != 0 or not os.path.isfile(result):
        raise NormplugError(f"the fine-tune failed (exit {returncode}); see {log_path}")
    return result


def control_stage(checkpoint: str, data_dir: str, loaded: LoadedCheckpoint, out: str, updates: int, lr: float,
                  evaluate, echo) -> dict:
    """``--control``: the unconverted LayerNorm model fine-tuned exactly as the converted one
    (same updates, lr, data), evaluated as a report stage; what the conversion's fine-tune is
    compared with in Heimersheim 2024 (the LayerNorm model fine-tuned alike)."""
    control_dir = report_paths(out)[2] + ".control"
    echo(f"[convert] control: the LayerNorm model fine-tuned {updates} updates (lr {lr:g}); log: "
         f"{control_dir}/train.log")
    tuned = finetune(checkpoint, loaded.data_bin, control_dir, updates, lr)
    return evaluate(load_checkpoint(tuned, data_dir).model,
                    f"LayerNorm + the same {updates}-update fine-tune (control)")


def stage_evaluator(loaded: LoadedCheckpoint, generation: dict, echo):
    """``evaluate(model, stage)``: the dev loss and BLEU of one report stage (echoed)."""
    criterion = loaded.task.build_criterion(loaded.cfg.criterion)

    def evaluate(model, stage):
        result = {"stage": stage, **evaluate_model(model, loaded.task, criterion, loaded.bpe, generation)}
        echo(f"[convert] {stage}: dev loss {result['loss']:.3f}, dev BLEU {result['bleu']:.2f}")
        return result

    return evaluate


def convert(checkpoint: str, data_dir: str, out: str, to: str = "dyt", finetune_updates: int = 0,
            finetune_lr: float = 1e-4, calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
            refit_gamma: bool = True, generation: Optional[dict] = None, echo=print,
            calibration: str = "layerwise", affine: Optional[str] = None, control: bool = False) -> dict:
    """Convert, evaluate and report (the module docstring); returns the report. ``affine``
    (``fitting.AFFINE_FITS``) defaults to ``"joint"``, or ``"keep"`` without ``refit_gamma``;
    ``control``: also the LayerNorm model fine-tuned alike (:func:`control_stage`)."""
    target = fitting.target(to)
    affine = fitting.affine_choice(affine, refit_gamma)
    if calibration not in CALIBRATIONS:
        raise NormplugError(f"unknown --calibration {calibration!r}; choose from {', '.join(CALIBRATIONS)}")
    if finetune_updates < 0 or calibration_tokens <= 0:
        raise NormplugError(f"--finetune-updates must be >= 0 and --calibration-tokens > 0, got "
                            f"{finetune_updates} and {calibration_tokens}")
    if control and not finetune_updates:
        raise NormplugError(f"--control fine-tunes the LayerNorm model as the converted one is: it needs "
                            f"--finetune-updates N > 0 with --to {to}")
    started = time.time()
    loaded, sites = load_layer_norm_model(checkpoint, data_dir, out)
    task = loaded.task
    generation = {**DEFAULT_GENERATION, **(generation or {})}
    evaluate = stage_evaluator(loaded, generation, echo)
    stages = [evaluate(loaded.model, "before conversion (LayerNorm)")]
    samples = list(batches(task, "train", CALIBRATION_BATCH_TOKENS, limit_tokens=calibration_tokens))
    source_tokens = sum(int(sample["net_input"]["src_tokens"].ne(task.source_dictionary.pad()).sum())
                        for sample in samples)
    echo(f"[convert] calibrating {len(sites)} norms ({calibration}, affine {affine}) on "
         f"{source_tokens} source tokens of the training set")
    calibrated, fits = calibrate(loaded, samples, target, calibration, affine)
    naive = replace_norms(loaded.model, lambda name, norm: target.naive(norm))
    naive_alpha = float(named_norms(naive)[sites[0]].alpha)
    stages.append(evaluate(naive, f"naive swap ({to}, alpha = {naive_alpha:g})"))

    save_checkpoint(converted_state(loaded, calibrated, target.norm_type), out)
    reloaded = load_checkpoint(out, data_dir)  # what fairseq-generate will load
    left = sorted({type(norm).__name__ for norm in named_norms(reloaded.model).values()
                   if fitting.is_layer_norm(norm)})
    if left:
        raise NormplugError(f"internal error: {out} still holds {left}")
    stages.append(evaluate(reloaded.model, f"calibrated {to} (no training)"))
    finetune_dir = report_paths(out)[2]
    finetuned = None
    if finetune_updates:
        echo(f"[convert] fine-tuning {finetune_updates} updates (lr {finetune_lr:g}); log: "
             f"{finetune_dir}/train.log")
        finetuned = finetune(out, loaded.data_bin, finetune_dir, finetune_updates, finetune_lr)
        stages.append(evaluate(load_checkpoint(finetuned, data_dir).model,
                               f"calibrated {to} + {finetune_updates}-update fine-tune"))
    if control:
        stages.append(control_stage(checkpoint, data_dir, loaded, out, finetune_updates, finetune_lr, evaluate, echo))
    naive_loss, calibrated_loss = stages[1]["loss"], stages[2]["loss"]
    report = {
        "checkpoint": checkpoint, "data": data_dir, "to": to, "out": out, "finetuned": finetuned,
        "calibration_tokens": calibration_tokens, "calibration_source_tokens": source_tokens,
        "calibration": calibration, "affine": affine, "refit_gamma": affine != "keep", "generation": generation,
        "finetune": {"updates": finetune_updates, "lr": finetune_lr}, "control": control,
        "stages": stages, "calibration_beats_naive": calibrated_loss < naive_loss, "fits": fits,
        "minutes": round((time.time() - started) / 60, 2),
    }
    json_path, md_path = write_report(out, report, render_markdown(report))
    verdict = "beats" if report["calibration_beats_naive"] else "does NOT beat"
    echo(f"[convert] calibration {verdict} the naive swap on dev loss: {calibrated_loss:.3f} vs "
         f"{naive_loss:.3f}")
    echo(f"[convert] wrote {out}, {json_path}, {md_path}")
    return report


def main(argv=None) -> dict:
    from fairseq_normplug.diagnostics import remove_norms  # it builds on this module

    parser = checkpoint_parser("convert_norms.sh", __doc__)
    parser.add_argument("out", help="output checkpoint path")
    parser.add_argument("--to", default="dyt",
                        help=f"target norm type: {', '.join(fitting.TARGETS)} (default dyt), folded (a TaperNorm "
                             f"model at gate 0: diagnostics/fold.py) or none (LayerNorm removed by fine-tuning: "
                             f"remove_norms.py)")
    parser.add_argument("--finetune-updates", type=int, default=0, metavar="N",
                        help="fine-tune the converted model N updates afterwards (default 0: none)")
    parser.add_argument("--finetune-lr", type=float, default=1e-4, help="its constant lr (default 1e-4)")
    parser.add_argument("--control", action="store_true",
                        help="also fine-tune the unconverted LayerNorm model the same way (updates, lr) and "
                             "report it: what the fine-tune alone gives (--to dyt|derf with --finetune-updates, "
                             "--to none)")
    parser.add_argument("--calibration-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS, metavar="N",
                        help=f"source tokens of the training set used for calibration (default "
                             f"{DEFAULT_CALIBRATION_TOKENS}; at most {MAX_FIT_ROWS} rows per norm are fitted)")
    parser.add_argument("--removal-every", type=int, default=None, metavar="K",
                        help=f"--to none: updates between two norm removals (default "
                             f"{remove_norms.DEFAULT_REMOVAL_EVERY})")
    parser.add_argument("--removal-start", type=int, default=None, metavar="S",
                        help="--to none: the first norm is removed after S updates (default K)")
    parser.add_argument("--calibration", default=None,
                        help="layerwise (default: norm k fitted on its inputs with norms < k converted) "
                             "or per-norm (every norm on the original model's activations)")
    parser.add_argument("--affine", default=None,
                        help="gamma/beta: joint (default: fitted per channel with alpha), gamma (beta "
                             "copied, gamma refitted) or keep (both copied)")
    parser.add_argument("--keep-gamma", action="store_true",
                        help="copy gamma and beta unchanged, fit alpha only (same as --affine keep)")
    parser.add_argument("--beam", type=int, default=DEFAULT_GENERATION["beam"], help="dev BLEU beam (4)")
    parser.add_argument("--lenpen", type=float, default=DEFAULT_GENERATION["lenpen"],
                        help="dev BLEU length penalty (0.6)")
    args = parser.parse_args(argv)
    try:
        if args.to not in (*fitting.TARGETS, "folded", "none"):
            raise NormplugError(f"unknown conversion target --to {args.to!r}; choose from "
                                f"{', '.join(fitting.TARGETS)}, folded, none")
        given = [flag for flag, value in (("--removal-every", args.removal_every),
                                           ("--removal-start", args.removal_start)) if value is not None]
        if given and args.to != "none":
            raise NormplugError(f"{given[0]} applies to --to none, not --to {args.to}")
        if args.to == "none":
            return removal_main(args)
        if args.to == "folded":
            if args.control:
                raise NormplugError("--control applies to --to dyt|derf|none (a fine-tune to compare with), "
                                    "not --to folded")
            from fairseq_normplug.diagnostics import fold
            return fold.fold_checkpoint(args.checkpoint, args.data, args.out,
                                        {"beam": args.beam, "lenpen": args.lenpen})
        if args.keep_gamma and args.affine not in (None, "keep"):
            raise NormplugError(f"--keep-gamma contradicts --affine {args.affine}; pass one of them")
        report = convert(args.checkpoint, args.data, args.out, args.to, args.finetune_updates,
                         args.finetune_lr, args.calibration_tokens, not args.keep_gamma,
                         {"beam": args.beam, "lenpen": args.lenpen}, calibration=args.calibration or "layerwise",
                         affine=args.affine, control=args.control)
    except NormplugError as error:
        sys.exit(f"convert_norms.sh: error: {error}")
    if not report["calibration_beats_naive"]:
        sys.exit(NOT_BETTER_EXIT_CODE)
    return report


def removal_main(args) -> dict:
    """``--to none`` (``remove_norms.remove``); the calibration flags of DyT/Derf are refused."""
    given = [flag for flag, value in (("--calibration", args.calibration), ("--affine", args.affine),
                                       ("--keep-gamma", args.keep_gamma or None)) if value is not None]
    if given:
        raise NormplugError(f"{given[0]} applies to --to {'|'.join(fitting.TARGETS)}, not --to none")
    from fairseq_normplug.diagnostics import remove_norms

    return remove_norms.remove(args.checkpoint, args.data, args.out, args.finetune_updates, args.finetune_lr,
                               args.calibration_tokens, args.removal_every,
                               args.removal_start, {"beam": args.beam, "lenpen": args.lenpen}, control=args.control)


if __name__ == "__main__":
    main(sys.argv[1:])
