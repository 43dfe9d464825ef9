"""The papers' figures from parsed training logs (:mod:`training_log`), as PNG files.

Each ``plot_*`` function takes ``{label: TrainingLog}`` and an output path, writes the PNG
atomically and returns the plotted data, so callers and tests can check it. A figure uses
the logs that hold its keys and raises :class:`MissingLogData` when none does:

=====================  =================================  ===================================
figure                 paper                              log keys (training flags)
=====================  =================================  ===================================
dev_bleu               Tears Fig. 1: dev BLEU vs updates  ``valid_bleu`` (``--eval-bleu``)
grad_norm              Tears Fig. 2: gradient norm        ``gnorm`` (always logged)
scalenorm_g            Tears Fig. 3: final g per layer    ``g:<norm>`` (``--scalenorm
                                                          --norm-stats-interval N``)
label_smoothing_g      Tears Fig. 4: decoder g with and   ``g:dec*`` in two logs whose
                       without label smoothing            ``--label-smoothing`` differs
dyt_alpha              DyT: final alpha per layer; alpha  ``alpha:<norm>``, ``in_std:<norm>``
                       vs 1/std over training             (``--dyt --norm-stats-interval N``)
dyt_saturation         DyT: saturated fraction (|alpha x|  ``sat:<norm>`` (``--dyt
                       > 2) of every norm over training   --norm-stats-interval N``)
=====================  =================================  ===================================

Command line (makes every figure the logs support, says why it skips the others)::

    python -m fairseq_normplug.experiments.figures --log PreNorm=runs/a/train.log \\
        --log PostNorm=runs/b/train.log --out results/figures [--figures dev_bleu grad_norm]
"""
import argparse
import logging
import math
import os
import re
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# importing fairseq (via the plugin package) sets the root logger to DEBUG; keep
# matplotlib's font-search chatter out of the output
logging.getLogger("matplotlib").setLevel(logging.WARNING)
from matplotlib import colormaps  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fairseq_normplug.errors import NormplugError  # noqa: E402
from fairseq_normplug.experiments.tables import atomic_output  # noqa: E402
from fairseq_normplug.experiments.training_log import TrainingLog, parse_training_log  # noqa: E402

Logs = Dict[str, TrainingLog]
NORM_NAME = re.compile(r"^(?P<stack>enc|dec)(?P<layer>\d+)?\.(?P<sublayer>attn|cross|ffn|final)$")
SUBLAYER_ORDER = {"attn": 0, "cross": 1, "ffn": 2}
STACK_ORDER = {"enc": 0, "dec": 1}
G_PANELS = (("enc.attn", "Encoder self-attention"), ("enc.ffn", "Encoder FFN"),
            ("dec.attn", "Decoder self-attention"), ("dec.cross", "Decoder enc-dec attention"),
            ("dec.ffn", "Decoder FFN"))
DYT_TRACKED_NORMS = 3


class MissingLogData(NormplugError):
    """None of the given logs holds the keys a figure needs."""


def parse_norm_name(name: str) -> Tuple[str, Optional[int], str]:
    """``dec1.cross`` -> ("dec", 1, "cross"); ``enc.final`` -> ("enc", None, "final")."""
    match = NORM_NAME.match(name)
    if not match:
        raise NormplugError(f"unknown norm name {name!r} (expected e.g. enc0.attn, dec1.cross, dec.final)")
    layer = match.group("layer")
    return match.group("stack"), None if layer is None else int(layer), match.group("sublayer")


def norm_sort_key(name: str) -> Tuple[int, float, int]:
    """Forward order of norm names: encoder before decoder, layer by layer (attn, cross,
    ffn), the stack's final norm last."""
    stack, layer, sublayer = parse_norm_name(name)
    return STACK_ORDER[stack], math.inf if layer is None else layer, SUBLAYER_ORDER.get(sublayer, 0)


def _sorted_norms(values: Dict[str, float]) -> Dict[str, float]:
    return {name: values[name] for name in sorted(values, key=norm_sort_key)}


def _logs_with(logs: Logs, select: Callable[[TrainingLog], bool], figure: str, need: str) -> Logs:
    chosen = {label: log for label, log in logs.items() if select(log)}
    if not chosen:
        raise MissingLogData(f"{figure}: no log has {need}")
    return chosen


def save_figure(fig: Figure, path: str) -> None:
    """Write ``fig`` to ``path`` as a PNG, atomically."""
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def _line_figure(series: Dict[str, Tuple[List[float], List[float]]], path: str, title: str,
                 ylabel: str, log_y: bool = False) -> None:
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=label)
    if log_y and all(y > 0 for _, ys in series.values() for y in ys):
        ax.set_yscale("log")
        ylabel += " (log scale)"
    ax.set(title=title, xlabel="updates", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def plot_dev_bleu(logs: Logs, path: str) -> Dict[str, Tuple[List[float], List[float]]]:
    """Tears Fig. 1: dev BLEU against updates, one line per log. Returns {label: (updates, bleu)}."""
    chosen = _logs_with(logs, lambda log: "valid_bleu" in log.keys("valid"), "dev_bleu",
                        "valid_bleu (train with --eval-bleu)")
    series = {label: log.series("valid", "valid_bleu") for label, log in chosen.items()}
    _line_figure(series, path, "Dev BLEU during training (cf. Transformers without Tears, Fig. 1)",
                 "dev BLEU")
    return series


def plot_grad_norm(logs: Logs, path: str) -> Dict[str, Tuple[List[float], List[float]]]:
    """Tears Fig. 2: global gradient norm (before clipping, averaged over each log interval)
    against updates, log scale. Returns {label: (updates, gnorm)}."""
    chosen = _logs_with(logs, lambda log: "gnorm" in log.keys("train_inner"), "grad_norm",
                        "gnorm in train_inner records")
    series = {label: log.series("train_inner", "gnorm") for label, log in chosen.items()}
    _line_figure(series, path, "Global gradient norm (cf. Transformers without Tears, Fig. 2)",
                 "gradient norm", log_y=True)
    return series


def _g_panels(g: Dict[str, float]) -> Dict[str, Tuple[list, List[float]]]:
    points: Dict[str, list] = {}
    for name in sorted(g, key=norm_sort_key):
        stack, layer, sublayer = parse_norm_name(name)
        key, x = ("final", stack) if layer is None else (f"{stack}.{sublayer}", layer)
        points.setdefault(key, []).append((x, g[name]))
    return {key: ([x for x, _ in xy], [y for _, y in xy]) for key, xy in points.items()}


def plot_scalenorm_g(logs: Logs, path: str) -> Dict[str, Dict[str, Tuple[list, List[float]]]]:
    """Tears Fig. 3: the last logged ScaleNorm g of every norm, one panel per sublayer type
    (x: layer) plus the stacks' final norms, one line per log. Returns
    {label: {panel: (xs, g)}} with panels ``enc.attn``, ``enc.ffn``, ``dec.attn``,
    ``dec.cross``, ``dec.ffn`` and ``final`` (xs ``enc``/``dec``; PreNorm only)."""
    chosen = _logs_with(logs, lambda log: bool(log.latest("train_inner", "g:")), "scalenorm_g",
                        "g:<norm> keys (train with --scalenorm --norm-stats-interval N)")
    data = {label: _g_panels(log.latest("train_inner", "g:")) for label, log in chosen.items()}
    fig = Figure(figsize=(13, 7), layout="constrained")
    axes = fig.subplots(2, 3)
    for ax, (key, title) in zip(axes.flat, G_PANELS + (("final", "Final norms (PreNorm)"),)):
        for label, panels in data.items():
            if key in panels:
                xs, ys = panels[key]
                ax.plot(xs, ys, marker="o", label=label)
        ax.set(title=title, xlabel="stack" if key == "final" else "layer", ylabel="g")
        ax.ticklabel_format(axis="y", useOffset=False)
        if key != "final":
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("Learned ScaleNorm g per layer (cf. Transformers without Tears, Fig. 3)")
    save_figure(fig, path)
    return data


def _smoothing_label(label: str, smoothing: float) -> str:
    return f"{label} (label smoothing {smoothing:g})" if smoothing else f"{label} (no label smoothing)"


def plot_label_smoothing_g(logs: Logs, path: str) -> Dict[str, Tuple[List[str], List[float]]]:
    """Tears Fig. 4: the last logged g of every decoder norm (forward order, the final norm
    feeding the output layer last) for runs with different label smoothing, read from each
    log's configuration dump. Returns {label: (norm names, g)}."""
    chosen = _logs_with(
        logs, lambda log: log.label_smoothing is not None and any(
            name.startswith("dec") for name in log.latest("train_inner", "g:")),
        "label_smoothing_g", "decoder g:<norm> keys and a configuration dump")
    if len({log.label_smoothing for log in chosen.values()}) < 2:
        raise MissingLogData("label_smoothing_g: needs logs with g:<norm> keys from runs with "
                             "different --label-smoothing (e.g. 0.1 and 0)")
    data = {}
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, log in chosen.items():
        g = _sorted_norms({name: value for name, value in log.latest("train_inner", "g:").items()
                           if name.startswith("dec")})
        data[label] = (list(g), list(g.values()))
        ax.plot(range(len(g)), list(g.values()), marker="o",
                label=_smoothing_label(label, log.label_smoothing))
    longest = max(data.values(), key=lambda names_values: len(names_values[0]))[0]
    ax.set_xticks(range(len(longest)), longest, rotation=45, ha="right")
    ax.set(title="Decoder ScaleNorm g with and without label smoothing "
                 "(cf. Transformers without Tears, Fig. 4)", xlabel="decoder norm", ylabel="g")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)
    return data


def _evenly_spaced(names: List[str], count: int) -> List[str]:
    if len(names) <= count:
        return names
    return [names[round(i * (len(names) - 1) / (count - 1))] for i in range(count)]


def plot_dyt_alpha(logs: Logs, path: str) -> dict:
    """DyT paper's analysis of alpha. Left: the last logged alpha of every norm (forward
    order), one line per log. Right: alpha (solid) and 1/std of the norm's input (dashed)
    over training for a few norms of the first log. Returns ``{"final_alpha": {label:
    {norm: alpha}}, "tracked_log": label, "tracked": {norm: (updates, alpha, 1/std)}}``."""
    chosen = _logs_with(logs, lambda log: bool(log.latest("train_inner", "alpha:")), "dyt_alpha",
                        "alpha:<norm> keys (train with --dyt --norm-stats-interval N)")
    final_alpha = {label: _sorted_norms(log.latest("train_inner", "alpha:")) for label, log in chosen.items()}
    tracked_label, tracked_log = next(iter(chosen.items()))
    tracked = {}
    for name in _evenly_spaced(list(final_alpha[tracked_label]), DYT_TRACKED_NORMS):
        updates, alphas = tracked_log.series("train_inner", f"alpha:{name}")
        std_updates, stds = tracked_log.series("train_inner", f"in_std:{name}")
        inverse_std = dict(zip(std_updates, (1.0 / s if s else math.nan for s in stds)))
        tracked[name] = (updates, alphas, [inverse_std.get(u, math.nan) for u in updates])

    fig = Figure(figsize=(13, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    for label, alphas in final_alpha.items():
        left.plot(range(len(alphas)), list(alphas.values()), marker="o", label=label)
    names = max(final_alpha.values(), key=len)
    left.set_xticks(range(len(names)), list(names), rotation=60, ha="right", fontsize=8)
    left.set(title="Learned DyT alpha per norm", xlabel="norm (forward order)", ylabel="alpha")
    left.grid(alpha=0.3)
    left.legend()
    for index, (name, (updates, alphas, inverse_std)) in enumerate(tracked.items()):
        color = f"C{index}"
        right.plot(updates, alphas, color=color, marker="o", markersize=3, label=f"alpha {name}")
        right.plot(updates, inverse_std, color=color, linestyle="--", label=f"1/std {name}")
    right.set(title=f"alpha tracks 1/std of its input ({tracked_label})", xlabel="updates",
              ylabel="value")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle("DyT alpha (cf. Transformers without Normalization, Section 6)")
    save_figure(fig, path)
    return {"final_alpha": final_alpha, "tracked_log": tracked_label, "tracked": tracked}


def cm_color(index: int, count: int):
    """The ``index``-th of ``count`` colours spread over the viridis map (forward order)."""
    return colormaps["viridis"](index / max(count - 1, 1))


def plot_dyt_saturation(logs: Logs, path: str) -> Dict[str, Dict[str, Tuple[List[float], List[float]]]]:
    """The saturated fraction of every DyT norm's input (``|alpha x| > 2``, tanh's flat
    part) over training, one panel per log, one line per norm (forward order). Returns
    {label: {norm: (updates, fraction)}}."""
    chosen = _logs_with(logs, lambda log: bool(log.latest("train_inner", "sat:")), "dyt_saturation",
                        "sat:<norm> keys (train with --dyt --norm-stats-interval N)")
    data = {label: {name: log.series("train_inner", f"sat:{name}")
                    for name in _sorted_norms(log.latest("train_inner", "sat:"))}
            for label, log in chosen.items()}
    fig = Figure(figsize=(6.5 * len(data), 4.5), layout="constrained")
    axes = fig.subplots(1, len(data), squeeze=False)[0]
    for ax, (label, series) in zip(axes, data.items()):
        for index, (name, (updates, fractions)) in enumerate(series.items()):
            ax.plot(updates, fractions, color=cm_color(index, len(series)), linewidth=1.2, label=name)
        ax.set(title=label, xlabel="updates", ylabel="saturated fraction")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("DyT inputs in tanh's flat part, |alpha x| > 2 (cf. Transformers without "
                 "Normalization, Sections 3-4)")
    save_figure(fig, path)
    return data


FIGURES: Dict[str, Tuple[str, Callable[[Logs, str], object]]] = {
    "dev_bleu": ("fig1_dev_bleu.png", plot_dev_bleu),
    "grad_norm": ("fig2_grad_norm.png", plot_grad_norm),
    "scalenorm_g": ("fig3_scalenorm_g.png", plot_scalenorm_g),
    "label_smoothing_g": ("fig4_label_smoothing_g.png", plot_label_smoothing_g),
    "dyt_alpha": ("dyt_alpha.png", plot_dyt_alpha),
    "dyt_saturation": ("dyt_saturation.png", plot_dyt_saturation),
}


def make_figures(logs: Logs, out_dir: str, names: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """Draw the figures ``names`` (default: all) into ``out_dir``. Returns {name: PNG path,
    or ``"skipped: <reason>"`` when the logs lack the figure's keys}."""
    names = list(FIGURES) if names is None else list(names)
    unknown = [name for name in names if name not in FIGURES]
    if unknown:
        raise NormplugError(f"unknown figure {unknown[0]!r}; choose from {', '.join(FIGURES)}")
    outcome = {}
    for name in names:
        filename, plot = FIGURES[name]
        path = os.path.join(out_dir, filename)
        try:
            plot(logs, path)
            outcome[name] = path
        except MissingLogData as missing:
            outcome[name] = f"skipped: {missing}"
    return outcome


def load_logs(paths: Dict[str, str]) -> Logs:
    """{label: log path} -> {label: parsed log}."""
    return {label: parse_training_log(path) for label, path in paths.items()}


def parse_log_specs(specs: Sequence[str]) -> Dict[str, str]:
    """``["LABEL=path.log", ...]`` -> {label: path}."""
    paths = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise NormplugError(f"--log {spec!r}: expected LABEL=PATH")
        if label in paths:
            raise NormplugError(f"--log label {label!r} given twice")
        paths[label] = path
    return paths


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, str]:
    parser = argparse.ArgumentParser(prog="python -m fairseq_normplug.experiments.figures",
                                     description="Draw the papers' figures from fairseq JSON training logs.")
    parser.add_argument("--log", action="append", required=True, metavar="LABEL=PATH",
                        help="a training log (fairseq-train --log-format json output) and its legend label")
    parser.add_argument("--out", required=True, help="output folder for the PNG files")
    parser.add_argument("--figures", nargs="+", metavar="NAME", help=f"subset of: {', '.join(FIGURES)}")
    args = parser.parse_args(argv)
    outcome = make_figures(load_logs(parse_log_specs(args.log)), args.out, args.figures)
    for name, result in outcome.items():
        print(f"{name}: {result}")
    return outcome


if __name__ == "__main__":
    main(sys.argv[1:])
