"""The papers' figures from parsed training logs (:mod:`training_log`), as PNG files.

Each ``plot_*`` function takes ``{label: TrainingLog}`` and an output path, writes the PNG
atomically and returns the plotted data, so callers and tests can check it. A figure uses
the logs that hold its keys and raises :class:`MissingLogData` when none does.

**Seeds.** A label may hold a list of logs, one per training seed of the same row
(``{label: [log of seed 1, log of seed 2, ...]}``). Every figure then draws that label as
its seed band: the mean over the seeds as the line and the range (min to max) over them as a
shaded band, in place of one line per seed; at each x (update, layer, norm) over the seeds
that logged it. The returned data holds a :class:`SeedBand` for such a label. A label with
one log is drawn, and returned, exactly as without seeds.

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

(``--log LABEL=PATH`` given twice with one label: two seeds of that label, drawn as a band.)
"""
import argparse
import logging
import math
import os
import sys
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple, Union

# importing fairseq (via the plugin package) sets the root logger to DEBUG; keep
# matplotlib's font-search chatter out of the output
logging.getLogger("matplotlib").setLevel(logging.WARNING)
if TYPE_CHECKING:
    from matplotlib.figure import Figure

from fairseq_normplug.errors import NormplugError  # noqa: E402
from fairseq_normplug.atomic_files import atomic_output  # noqa: E402
from fairseq_normplug.experiments.training_log import TrainingLog, parse_training_log  # noqa: E402
from fairseq_normplug.experiments.figure_data import (  # noqa: E402,F401 (figures.SeedBand, ...)
    combine_seeds, Logs, _logs_with, MissingLogData, norm_sort_key, parse_norm_name, seed_band, SeedBand,
    Series, _sorted_norms,
)

def new_figure(**options) -> "Figure":
    """A matplotlib ``Figure(**options)`` (no pyplot, no display). matplotlib is imported here,
    on first use: the processes that draw nothing (launchers, train.sh, submitit's jobs) import
    this module through the runner and do not pay its 0.4 s import."""
    from matplotlib.figure import Figure

    return Figure(**options)


def colormap(name: str):
    """matplotlib's colormap ``name`` (imported on first use, as in :func:`new_figure`)."""
    from matplotlib import colormaps

    return colormaps[name]


G_PANELS = (("enc.attn", "Encoder self-attention"), ("enc.ffn", "Encoder FFN"),
            ("dec.attn", "Decoder self-attention"), ("dec.cross", "Decoder enc-dec attention"),
            ("dec.ffn", "Decoder FFN"))
DYT_TRACKED_NORMS = 3
BAND_ALPHA = 0.2


def _band_label(label: str, data: Series) -> str:
    if isinstance(data, SeedBand):
        return f"{label} (mean, min-max of {max(data.seeds)} seeds)"
    return label


def draw(ax, data: Series, label: Optional[str] = None, positions: Optional[Dict[object, float]] = None, **style):
    """Draw ``data`` on ``ax``: a line, or for a :class:`SeedBand` the mean line and a shaded
    min-max band in the same colour. ``positions`` maps xs to plot positions (named xs)."""
    xs = data[0] if positions is None else [positions[x] for x in data[0]]
    if not isinstance(data, SeedBand):
        return ax.plot(xs, data[1], label=label, **style)[0]
    line = ax.plot(xs, data.mean, label=None if label is None else _band_label(label, data), **style)[0]
    ax.fill_between(xs, data.low, data.high, color=line.get_color(), alpha=BAND_ALPHA, linewidth=0)
    return line


def save_figure(fig: "Figure", path: str) -> None:
    """Write ``fig`` to ``path`` as a PNG, atomically. A figure with a layout engine (the
    project's all use matplotlib's constrained layout, which keeps titles, labels and legends,
    those beside the axes too, inside the canvas) is written at its own size; only one without
    is cropped to a tight bounding box at save (a second layout pass, a quarter of a figure's
    time)."""
    crop = {} if fig.get_layout_engine() is not None else {"bbox_inches": "tight"}
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, **crop)


def _line_figure(series: Dict[str, Series], path: str, title: str, ylabel: str, log_y: bool = False) -> None:
    fig = new_figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, data in series.items():
        draw(ax, data, label, marker="o", markersize=3, linewidth=1.2)
    lows = [y for data in series.values() for y in (data.low if isinstance(data, SeedBand) else data[1])]
    if log_y and all(y > 0 for y in lows):
        ax.set_yscale("log")
        ylabel += " (log scale)"
    ax.set(title=title, xlabel="updates", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def _series_figure(logs: Logs, kind: str, key: str, figure: str, need: str, path: str, title: str,
                   ylabel: str, log_y: bool = False) -> Dict[str, Series]:
    chosen = _logs_with(logs, lambda log: key in log.keys(kind), figure, need, kind)
    series = {label: combine_seeds([log.series(kind, key) for log in group]) for label, group in chosen.items()}
    _line_figure(series, path, title, ylabel, log_y)
    return series


def plot_dev_bleu(logs: Logs, path: str) -> Dict[str, Series]:
    """Tears Fig. 1: dev BLEU against updates, one line per log (a band per label with several
    seeds). Returns {label: (updates, bleu) or SeedBand}."""
    return _series_figure(logs, "valid", "valid_bleu", "dev_bleu", "valid_bleu (train with --eval-bleu)", path,
                          "Dev BLEU during training (cf. Transformers without Tears, Fig. 1)", "dev BLEU")


def plot_grad_norm(logs: Logs, path: str) -> Dict[str, Series]:
    """Tears Fig. 2: global gradient norm (before clipping, averaged over each log interval)
    against updates, log scale. Returns {label: (updates, gnorm) or SeedBand}."""
    return _series_figure(logs, "train_inner", "gnorm", "grad_norm", "gnorm in train_inner records", path,
                          "Global gradient norm (cf. Transformers without Tears, Fig. 2)", "gradient norm",
                          log_y=True)


def _g_panels(g: Dict[str, float]) -> Dict[str, Tuple[list, List[float]]]:
    points: Dict[str, list] = {}
    for name in sorted(g, key=norm_sort_key):
        stack, layer, sublayer = parse_norm_name(name)
        key, x = ("final", stack) if layer is None else (f"{stack}.{sublayer}", layer)
        points.setdefault(key, []).append((x, g[name]))
    return {key: ([x for x, _ in xy], [y for _, y in xy]) for key, xy in points.items()}


def _combined_panels(per_seed: Sequence[Dict[str, Tuple[list, List[float]]]]) -> Dict[str, Series]:
    """{panel: series} of several seeds' {panel: (xs, ys)}: each panel combined over the seeds."""
    panels = list(dict.fromkeys(key for seed in per_seed for key in seed))
    return {key: combine_seeds([seed[key] for seed in per_seed if key in seed]) for key in panels}


def plot_scalenorm_g(logs: Logs, path: str) -> Dict[str, Dict[str, Series]]:
    """Tears Fig. 3: the last logged ScaleNorm g of every norm, one panel per sublayer type
    (x: layer) plus the stacks' final norms, one line per log (a band per label with several
    seeds). Returns {label: {panel: (xs, g) or SeedBand}} with panels ``enc.attn``,
    ``enc.ffn``, ``dec.attn``, ``dec.cross``, ``dec.ffn`` and ``final`` (xs ``enc``/``dec``;
    PreNorm only)."""
    chosen = _logs_with(logs, lambda log: bool(log.latest("train_inner", "g:")), "scalenorm_g",
                        "g:<norm> keys (train with --scalenorm --norm-stats-interval N)")
    data = {label: _combined_panels([_g_panels(log.latest("train_inner", "g:")) for log in group])
            for label, group in chosen.items()}
    fig = new_figure(figsize=(13, 7), layout="constrained")
    axes = fig.subplots(2, 3)
    for ax, (key, title) in zip(axes.flat, G_PANELS + (("final", "Final norms (PreNorm)"),)):
        positions = {"enc": 0, "dec": 1} if key == "final" else None
        for label, panels in data.items():
            if key in panels:
                draw(ax, panels[key], label, positions, marker="o")
        ax.set(title=title, xlabel="stack" if key == "final" else "layer", ylabel="g")
        ax.ticklabel_format(axis="y", useOffset=False)
        if key == "final":
            ax.set_xticks([0, 1], ["enc", "dec"])
        else:
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("Learned ScaleNorm g per layer (cf. Transformers without Tears, Fig. 3)")
    save_figure(fig, path)
    return data


def _smoothing_label(label: str, smoothing: float) -> str:
    return f"{label} (label smoothing {smoothing:g})" if smoothing else f"{label} (no label smoothing)"


def plot_label_smoothing_g(logs: Logs, path: str) -> Dict[str, Series]:
    """Tears Fig. 4: the last logged g of every decoder norm (forward order, the final norm
    feeding the output layer last) for runs with different label smoothing, read from each
    log's configuration dump. Returns {label: (norm names, g) or SeedBand}."""
    chosen = _logs_with(
        logs, lambda log: log.label_smoothing is not None and any(
            name.startswith("dec") for name in log.latest("train_inner", "g:")),
        "label_smoothing_g", "decoder g:<norm> keys and a configuration dump")
    if len({log.label_smoothing for group in chosen.values() for log in group}) < 2:
        raise MissingLogData("label_smoothing_g: needs logs with g:<norm> keys from runs with "
                             "different --label-smoothing (e.g. 0.1 and 0)")
    data = {}
    for label, group in chosen.items():
        per_seed = []
        for log in group:
            g = _sorted_norms({name: value for name, value in log.latest("train_inner", "g:").items()
                               if name.startswith("dec")})
            per_seed.append((list(g), list(g.values())))
        data[label] = combine_seeds(per_seed)
    longest = sorted({name for series in data.values() for name in series[0]}, key=norm_sort_key)
    positions = {name: index for index, name in enumerate(longest)}
    fig = new_figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, series in data.items():
        draw(ax, series, _smoothing_label(label, chosen[label][0].label_smoothing), positions, marker="o")
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


def _final_alpha(log: TrainingLog) -> Dict[str, float]:
    return _sorted_norms(log.latest("train_inner", "alpha:"))


def _tracked_series(log: TrainingLog, name: str) -> Tuple[List[float], List[float], List[float]]:
    """(updates, alpha, 1/std of the input) of one DyT norm over training."""
    updates, alphas = log.series("train_inner", f"alpha:{name}")
    std_updates, stds = log.series("train_inner", f"in_std:{name}")
    inverse_std = dict(zip(std_updates, (1.0 / s if s else math.nan for s in stds)))
    return updates, alphas, [inverse_std.get(u, math.nan) for u in updates]


def plot_dyt_alpha(logs: Logs, path: str) -> dict:
    """DyT paper's analysis of alpha. Left: the last logged alpha of every norm (forward
    order), one line per log. Right: alpha (solid) and 1/std of the norm's input (dashed)
    over training for a few norms of the first log. Returns ``{"final_alpha": {label:
    {norm: alpha}}, "tracked_log": label, "tracked": {norm: (updates, alpha, 1/std)}}``; a
    label with several seeds has a :class:`SeedBand` over the norms in ``final_alpha`` and,
    when it is the tracked one, ``(alpha SeedBand, 1/std SeedBand)`` per tracked norm."""
    chosen = _logs_with(logs, lambda log: bool(log.latest("train_inner", "alpha:")), "dyt_alpha",
                        "alpha:<norm> keys (train with --dyt --norm-stats-interval N)")
    final_alpha = {}
    for label, group in chosen.items():
        per_seed = [_final_alpha(log) for log in group]
        final_alpha[label] = per_seed[0] if len(group) == 1 else seed_band(
            [(list(alphas), list(alphas.values())) for alphas in per_seed])
    tracked_label, tracked_group = next(iter(chosen.items()))
    names = list(_final_alpha(tracked_group[0]))
    tracked = {}
    for name in _evenly_spaced(names, DYT_TRACKED_NORMS):
        per_seed = [_tracked_series(log, name) for log in tracked_group]
        if len(per_seed) == 1:
            tracked[name] = per_seed[0]
        else:
            tracked[name] = (seed_band([(u, a) for u, a, _ in per_seed]), seed_band([(u, i) for u, _, i in per_seed]))

    fig = new_figure(figsize=(13, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    all_names = sorted({name for alphas in final_alpha.values() for name in
                        (alphas.xs if isinstance(alphas, SeedBand) else alphas)}, key=norm_sort_key)
    positions = {name: index for index, name in enumerate(all_names)}
    for label, alphas in final_alpha.items():
        series = alphas if isinstance(alphas, SeedBand) else (list(alphas), list(alphas.values()))
        draw(left, series, label, positions, marker="o")
    left.set_xticks(range(len(all_names)), all_names, rotation=60, ha="right", fontsize=8)
    left.set(title="Learned DyT alpha per norm", xlabel="norm (forward order)", ylabel="alpha")
    left.grid(alpha=0.3)
    left.legend()
    for index, (name, series) in enumerate(tracked.items()):
        color = f"C{index}"
        if isinstance(series[0], SeedBand):
            alpha_series, inverse_series = series
        else:
            alpha_series, inverse_series = (series[0], series[1]), (series[0], series[2])
        draw(right, alpha_series, f"alpha {name}", color=color, marker="o", markersize=3)
        draw(right, inverse_series, f"1/std {name}", color=color, linestyle="--")
    right.set(title=f"alpha tracks 1/std of its input ({tracked_label})", xlabel="updates",
              ylabel="value")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle("DyT alpha (cf. Transformers without Normalization, Section 6)")
    save_figure(fig, path)
    return {"final_alpha": final_alpha, "tracked_log": tracked_label, "tracked": tracked}


def cm_color(index: int, count: int):
    """The ``index``-th of ``count`` colours spread over the viridis map (forward order)."""
    return colormap("viridis")(index / max(count - 1, 1))


def plot_dyt_saturation(logs: Logs, path: str) -> Dict[str, Dict[str, Series]]:
    """The saturated fraction of every DyT norm's input (``|alpha x| > 2``, tanh's flat
    part) over training, one panel per log, one line per norm (forward order; a band per norm
    for a label with several seeds). Returns {label: {norm: (updates, fraction) or SeedBand}}."""
    chosen = _logs_with(logs, lambda log: bool(log.latest("train_inner", "sat:")), "dyt_saturation",
                        "sat:<norm> keys (train with --dyt --norm-stats-interval N)")
    data = {}
    for label, group in chosen.items():
        names = sorted({name for log in group for name in log.latest("train_inner", "sat:")}, key=norm_sort_key)
        data[label] = {name: combine_seeds([log.series("train_inner", f"sat:{name}") for log in group
                                            if name in log.latest("train_inner", "sat:")]) for name in names}
    fig = new_figure(figsize=(6.5 * len(data), 4.5), layout="constrained")
    axes = fig.subplots(1, len(data), squeeze=False)[0]
    for ax, (label, series) in zip(axes, data.items()):
        for index, (name, fractions) in enumerate(series.items()):
            draw(ax, fractions, name, color=cm_color(index, len(series)), linewidth=1.2)
        ax.set(title=_band_label(label, next(iter(series.values()))), xlabel="updates",
               ylabel="saturated fraction")
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


def remove_stale_figures(out_dir: str, kept: Sequence[str] = ()) -> List[str]:
    """Delete the figures of :data:`FIGURES` in ``out_dir`` other than the paths ``kept`` (a figure
    an earlier table drew that this one does not); returns the deleted paths."""
    kept = {os.path.abspath(path) for path in kept}
    removed = []
    for filename, _ in FIGURES.values():
        path = os.path.join(out_dir, filename)
        if os.path.abspath(path) not in kept and os.path.isfile(path):
            os.remove(path)
            removed.append(path)
    return removed


def load_logs(paths: Dict[str, Union[str, Sequence[str]]]) -> Logs:
    """{label: log path, or the log paths of its seeds} -> {label: parsed log(s)}."""
    return {label: parse_training_log(path) if isinstance(path, str) else [parse_training_log(p) for p in path]
            for label, path in paths.items()}


def parse_log_specs(specs: Sequence[str]) -> Dict[str, Union[str, List[str]]]:
    """``["LABEL=path.log", ...]`` -> {label: path}; a label given several times -> {label:
    [path, ...]} (one log per seed, drawn as a band)."""
    paths: Dict[str, List[str]] = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise NormplugError(f"--log {spec!r}: expected LABEL=PATH")
        if path in paths.get(label, []):
            raise NormplugError(f"--log {label}={path} given twice")
        paths.setdefault(label, []).append(path)
    return {label: group[0] if len(group) == 1 else group for label, group in paths.items()}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, str]:
    parser = argparse.ArgumentParser(prog="python -m fairseq_normplug.experiments.figures",
                                     description="Draw the papers' figures from fairseq JSON training logs.")
    parser.add_argument("--log", action="append", required=True, metavar="LABEL=PATH",
                        help="a training log (fairseq-train --log-format json output) and its legend label; "
                             "one label given several times: its seeds, drawn as a band (mean, min-max)")
    parser.add_argument("--out", required=True, help="output folder for the PNG files")
    parser.add_argument("--figures", nargs="+", metavar="NAME", help=f"subset of: {', '.join(FIGURES)}")
    args = parser.parse_args(argv)
    outcome = make_figures(load_logs(parse_log_specs(args.log)), args.out, args.figures)
    for name, result in outcome.items():
        print(f"{name}: {result}")
    return outcome


if __name__ == "__main__":
    main(sys.argv[1:])
