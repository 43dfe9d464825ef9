"""The depth table's figures (experiments/depths.py): test BLEU (or the table's cell metric)
against layers per stack, one line per design, diverged and failed runs drawn as x on the
x-axis; and the train-loss curves of every design at the deepest depth that has logs."""
import os
from typing import Callable, Dict, List, Sequence

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.depths import by_design, depth_markdown
# figures quiets matplotlib's logger and imports matplotlib on first use (new_figure, colormap)
from fairseq_normplug.experiments.figures import colormap, new_figure, save_figure
from fairseq_normplug.experiments.training_log import parse_training_log
from fairseq_normplug.atomic_files import write_text_atomic

BLEU_FIGURE = "depth_bleu.png"
#: one marker per design beside its colour (tab20 has 20 colours; the designs are more than viridis can tell apart)
MARKERS = "os^vD<>pPhX*"


def design_style(index: int) -> dict:
    """The colour and marker of the ``index``-th design, the same in both figures."""
    return {"color": colormap("tab20")(index % 20), "marker": MARKERS[index % len(MARKERS)]}
LOSS_FIGURE = "depth_train_loss.png"


def plot_metric_against_depth(grid: Dict[str, Dict[int, dict]], depths: Sequence[int], path: str,
                              metric: str = "tokenized_bleu") -> Dict[str, dict]:
    """One line per design through its scored depths; a run without a score (diverged, failed)
    is an x at 0 in the design's colour. Returns {design: {"scored": [(layers, value)],
    "unscored": [(layers, status)]}}."""
    fig = new_figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.add_subplot()
    drawn = {}
    for index, (design, cells) in enumerate(grid.items()):
        style = design_style(index)
        scored = [(d, cells[d][metric]) for d in depths if d in cells and cells[d].get("status") == "ok"
                  and cells[d].get(metric) is not None]
        unscored = [(d, cells[d].get("status")) for d in depths
                    if d in cells and cells[d].get("status") in ("diverged", "failed")]
        if scored:
            ax.plot([d for d, _ in scored], [v for _, v in scored], markersize=5, label=design, **style)
        if unscored:
            ax.plot([d for d, _ in unscored], [0] * len(unscored), marker="x", markersize=10, linestyle="none",
                    color=style["color"], label=None if scored else f"{design} (no score)")
        drawn[design] = {"scored": scored, "unscored": unscored}
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(depths), [str(d) for d in depths])
    ax.set(title="Test score against depth (x: diverged or failed)", xlabel="layers per stack (encoder = decoder)",
           ylabel=metric.replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the lines, not over them
    save_figure(fig, path)
    return drawn


def plot_train_loss(logs: Dict[str, list], layers: int, path: str, designs: Sequence[str]) -> Dict[str, tuple]:
    """Train loss (fairseq's ``loss`` of train_inner records, base 2) against updates of each
    design at ``layers`` layers, each in its style of ``designs`` (the table's order). Returns
    {design: (updates, losses)}."""
    fig = new_figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.add_subplot()
    series = {}
    for design, log in logs.items():
        updates, losses = log.series("train_inner", "loss")
        if not updates:
            continue
        ax.plot(updates, losses, linewidth=1.1, markersize=3, markevery=2, label=design,
                **design_style(designs.index(design)))
        series[design] = (list(updates), list(losses))
    if not series:
        raise NormplugError(f"no train_inner loss in the logs of the runs at {layers} layers")
    ax.set(title=f"Train loss at {layers} layers per stack", xlabel="updates", ylabel="train loss (bits per token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the lines, not over them
    save_figure(fig, path)
    return series


def write_depth_outputs(table, runs: List, results: Sequence[dict], results_dir: str, metric: str,
                        echo: Callable[[str], None] = print) -> List[str]:
    """depth.md (the design x depth table) and the two figures into ``results_dir``; returns the
    paths written."""
    grid = by_design(results, table)
    written = [os.path.join(results_dir, "depth.md")]
    write_text_atomic(written[0], f"# {table.title}\n\n" + depth_markdown(results, table, metric)
                      + f"\n![{metric} against depth]({BLEU_FIGURE})\n\n![train loss at depth]({LOSS_FIGURE})\n")
    if any(cells for cells in grid.values()):
        path = os.path.join(results_dir, BLEU_FIGURE)
        plot_metric_against_depth(grid, table.depths, path, metric)
        written.append(path)
    with_logs = [run for run in runs if run.seed == 1 and os.path.exists(run.path("train.log"))]
    if with_logs:
        deepest = max(run.row.layers for run in with_logs)
        logs = {}
        for run in with_logs:
            if run.row.layers == deepest:
                try:
                    logs[run.row.design] = parse_training_log(run.path("train.log"))
                except (NormplugError, OSError) as error:
                    echo(f"[reproduce] {run.label}: {error}; left out of {LOSS_FIGURE}")
        path = os.path.join(results_dir, LOSS_FIGURE)
        try:
            plot_train_loss(logs, deepest, path, list(dict.fromkeys(row.design for row in table.rows)))
            written.append(path)
        except NormplugError as error:
            echo(f"[reproduce] figure {LOSS_FIGURE}: skipped: {error}")
    for path in written:
        echo(f"[reproduce] depth: {path}")
    return written
