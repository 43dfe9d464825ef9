"""``scripts/plot_norms.sh CKPT DATA OUT_DIR``: what every norm of a trained model does on
real data, as PNG figures and CSV tables.

The model runs (teacher forcing, evaluation mode) on a few batches of DATA's dev set
(``--subset``, ``--tokens``); hooks record the input and output of every norm site and the
attention logits of every layer. Written to OUT_DIR:

=========================  ==========================================================
``s_curves_enc.png``,      input vs output of every norm site, one panel per site (the
``s_curves_dec.png``       DyT paper's Figs. 2-4 S-curves), one grid per stack
``scale_vs_std.png``       per site: the norm's scale next to 1/std of its input (DyT
                           paper, section 6): DyT alpha, or the equivalent per-token
                           scale of the normalisers (LayerNorm mean 1/std, RMSNorm mean
                           1/rms, ScaleNorm mean g/||x||; Derf alpha); for DyT sites a second panel
                           with the saturated fraction ``|alpha x| > 2``
``attention.png``          per layer: the largest attention logit and the mean attention
                           entropy (nats) of each self- and cross-attention
``norms.csv``              one row per norm site: ``site, norm_type, in_std, inverse_std,
                           scale, scale_kind, gain, saturated_fraction, tokens``
``attention.csv``          one row per attention: ``attention, stack, layer, kind,
                           max_logit, entropy, queries``
=========================  ==========================================================
"""
import csv
import io
import logging
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch

logging.getLogger("matplotlib").setLevel(logging.WARNING)
from matplotlib.figure import Figure  # noqa: E402

from fairseq_normplug.atomic_files import write_text_atomic  # noqa: E402
from fairseq_normplug.diagnostics.attention import collect_attention_statistics  # noqa: E402
from fairseq_normplug.diagnostics.loading import (  # noqa: E402
    batches, checkpoint_parser, collect_norm_activations, load_checkpoint,
)
from fairseq_normplug.errors import NormplugError  # noqa: E402
from fairseq_normplug.experiments.figures import save_figure  # noqa: E402
from fairseq_normplug.modules.norm_base import effective_gain  # noqa: E402
from fairseq_normplug.modules.norm_registry import norm_type_of  # noqa: E402

NORM_CSV_FIELDS = ("site", "norm_type", "in_std", "inverse_std", "scale", "scale_kind", "gain",
                   "saturated_fraction", "tokens")
ATTENTION_CSV_FIELDS = ("attention", "stack", "layer", "kind", "max_logit", "entropy", "queries")
POINTS_PER_PANEL = 4000
BATCH_TOKENS = 1000


def _row_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm(dim=-1)


def equivalent_scale(norm, x: torch.Tensor):
    """(scale, kind): the factor the norm applies to its input before its gain, averaged
    over tokens, the quantity the DyT paper compares with 1/std of the input (section 6)."""
    eps = float(getattr(norm, "eps", 1e-5))
    kind = type(norm).__name__
    if norm_type_of(norm) == "layernorm":
        return float((x.var(dim=-1, unbiased=False) + eps).rsqrt().mean()), "mean 1/std per token"
    if kind == "RMSNorm":
        return float((x.pow(2).mean(dim=-1) + eps).rsqrt().mean()), "mean 1/rms per token"
    if kind == "ScaleNorm":
        return float((float(norm.g) / _row_norm(x).clamp_min(eps)).mean()), "mean g/||x|| per token"
    if isinstance(getattr(norm, "alpha", None), torch.Tensor):
        return float(norm.alpha.detach().float().mean()), "alpha"  # a per-channel alpha: its mean
    return math.nan, "unknown"


def site_statistics(name: str, norm, x: torch.Tensor) -> dict:
    """One ``norms.csv`` row."""
    scale, kind = equivalent_scale(norm, x)
    in_std = float(x.std())
    weight = effective_gain(norm)  # 1 + gamma with --zero-centered-gamma
    saturated = norm.saturated_fraction(x) if hasattr(norm, "saturated_fraction") else None
    return {"site": name, "norm_type": norm_type_of(norm),
            "in_std": in_std, "inverse_std": 1.0 / in_std if in_std else math.nan, "scale": scale,
            "scale_kind": kind,
            "gain": float(weight.detach().abs().mean()) if isinstance(weight, torch.Tensor) else None,
            "saturated_fraction": saturated, "tokens": int(x.shape[0])}


def attention_row(name: str, stats: dict) -> dict:
    stack_layer, kind = name.split(".")
    return {"attention": name, "stack": stack_layer[:3], "layer": int(stack_layer[3:]), "kind": kind,
            "max_logit": stats["max_logit"], "entropy": stats["entropy"], "queries": stats["queries"]}


def render_csv(rows: Sequence[dict], fields: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(fields), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if row[key] is None else row[key] for key in fields})
    return buffer.getvalue()


def plot_s_curves(activations: Dict[str, tuple], rows: Dict[str, dict], stack: str, path: str,
                  points: int = POINTS_PER_PANEL, seed: int = 0) -> Dict[str, int]:
    """Input vs output of every norm site of ``stack`` ("enc" or "dec"), one panel each
    (forward order), ``points`` random elements per panel. Returns {site: points drawn}."""
    sites = [name for name in activations if name.startswith(stack)]
    columns = min(3, len(sites))
    rows_count = math.ceil(len(sites) / columns)
    fig = Figure(figsize=(3.6 * columns, 3.0 * rows_count), layout="constrained")
    axes = list(fig.subplots(rows_count, columns, squeeze=False).flat)
    generator = torch.Generator().manual_seed(seed)
    drawn = {}
    for ax, name in zip(axes, sites):
        _, x, y = activations[name]
        x, y = x.flatten(), y.flatten()
        chosen = torch.randperm(x.numel(), generator=generator)[:points]
        ax.scatter(x[chosen].numpy(), y[chosen].numpy(), s=1.5, alpha=0.35, linewidths=0, rasterized=True)
        row = rows[name]
        extra = f", alpha {row['scale']:.2f}" if row["scale_kind"] == "alpha" else ""
        if row["saturated_fraction"] is not None:
            extra += f", sat {row['saturated_fraction']:.1%}"
        ax.set_title(f"{name} ({row['norm_type']}{extra})", fontsize=9)
        ax.set_xlabel("input", fontsize=8)
        ax.set_ylabel("output", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        drawn[name] = int(chosen.numel())
    for ax in axes[len(sites):]:
        ax.set_visible(False)
    stack_name = {"enc": "Encoder", "dec": "Decoder"}[stack]
    fig.suptitle(f"{stack_name} norms: input vs output (cf. Transformers without Normalization, Figs. 2-4)")
    save_figure(fig, path)
    return drawn


def plot_scale_vs_std(rows: List[dict], path: str) -> dict:
    """Per site (forward order): the norm's scale and 1/std of its input; for DyT sites the
    saturated fraction too. Returns the plotted values."""
    sites = [row["site"] for row in rows]
    saturated = {row["site"]: row["saturated_fraction"] for row in rows if row["saturated_fraction"] is not None}
    fig = Figure(figsize=(max(7, 0.45 * len(sites)) * (2 if saturated else 1) * 0.75, 4.5),
                 layout="constrained")
    axes = fig.subplots(1, 2 if saturated else 1, squeeze=False)[0]
    kinds = sorted({row["scale_kind"] for row in rows})
    axes[0].plot(range(len(sites)), [row["scale"] for row in rows], marker="o",
                 label=f"norm scale ({'; '.join(kinds)})")
    axes[0].plot(range(len(sites)), [row["inverse_std"] for row in rows], marker="s", linestyle="--",
                 label="1/std of the input")
    axes[0].set_xticks(range(len(sites)), sites, rotation=60, ha="right", fontsize=8)
    axes[0].set(title="Scale vs 1/std of the input (cf. DyT paper, section 6)", ylabel="value")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if saturated:
        axes[1].bar(range(len(saturated)), list(saturated.values()))
        axes[1].set_xticks(range(len(saturated)), list(saturated), rotation=60, ha="right", fontsize=8)
        axes[1].set(title="DyT saturated fraction, |alpha x| > 2", ylabel="fraction of inputs")
        axes[1].grid(alpha=0.3, axis="y")
    save_figure(fig, path)
    return {"sites": sites, "scale": [row["scale"] for row in rows],
            "inverse_std": [row["inverse_std"] for row in rows], "saturated_fraction": saturated}


def plot_attention(rows: List[dict], path: str) -> Dict[str, dict]:
    """Largest logit and mean entropy per layer, one line per attention kind. Returns
    {"enc.self" | "dec.self" | "dec.cross": {"layers", "max_logit", "entropy"}}."""
    series: Dict[str, dict] = {}
    for row in rows:
        entry = series.setdefault(f"{row['stack']}.{row['kind']}", {"layers": [], "max_logit": [], "entropy": []})
        for key, value in (("layers", row["layer"]), ("max_logit", row["max_logit"]), ("entropy", row["entropy"])):
            entry[key].append(value)
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    for label, entry in series.items():
        left.plot(entry["layers"], entry["max_logit"], marker="o", label=label)
        right.plot(entry["layers"], entry["entropy"], marker="o", label=label)
    left.set(title="Largest attention logit", xlabel="layer", ylabel="logit")
    right.set(title="Mean attention entropy", xlabel="layer", ylabel="entropy (nats)")
    for ax in (left, right):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path)
    return series


def plot_norms(checkpoint: str, data_dir: str, out_dir: str, subset: str = "valid", tokens: int = 2000,
               points: int = POINTS_PER_PANEL, echo=print) -> dict:
    """Write the figures and tables of the module docstring; returns what each figure plots
    and the table rows: {"norms": rows, "attention": rows, "figures": {file: plotted data}}."""
    if tokens <= 0 or points <= 0:
        raise NormplugError(f"--tokens and --points must be > 0, got {tokens} and {points}")
    loaded = load_checkpoint(checkpoint, data_dir)
    try:
        samples = list(batches(loaded.task, subset, BATCH_TOKENS, limit_tokens=tokens))
    except FileNotFoundError as error:
        raise NormplugError(f"{data_dir} has no {subset!r} subset ({error})") from None
    activations = collect_norm_activations(loaded, samples)
    if not activations:
        raise NormplugError(f"{checkpoint} has no norm layers to plot")
    norm_rows = [site_statistics(name, norm, x) for name, (norm, x, _) in activations.items()]
    by_site = {row["site"]: row for row in norm_rows}
    attention_rows = [attention_row(name, stats)
                      for name, stats in collect_attention_statistics(loaded, samples).items()]
    os.makedirs(out_dir, exist_ok=True)
    figures = {}
    for stack in ("enc", "dec"):
        if any(name.startswith(stack) for name in activations):
            filename = f"s_curves_{stack}.png"
            figures[filename] = plot_s_curves(activations, by_site, stack, os.path.join(out_dir, filename), points)
    figures["scale_vs_std.png"] = plot_scale_vs_std(norm_rows, os.path.join(out_dir, "scale_vs_std.png"))
    figures["attention.png"] = plot_attention(attention_rows, os.path.join(out_dir, "attention.png"))
    write_text_atomic(os.path.join(out_dir, "norms.csv"), render_csv(norm_rows, NORM_CSV_FIELDS))
    write_text_atomic(os.path.join(out_dir, "attention.csv"), render_csv(attention_rows, ATTENTION_CSV_FIELDS))
    echo(f"[plot_norms] {len(norm_rows)} norm sites, {len(attention_rows)} attentions on "
         f"{norm_rows[0]['tokens']} {subset} tokens; wrote {', '.join(sorted(figures))}, norms.csv, "
         f"attention.csv to {out_dir}")
    return {"norms": norm_rows, "attention": attention_rows, "figures": figures}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = checkpoint_parser("plot_norms.sh", __doc__)
    parser.add_argument("out_dir", help="output folder for the PNG and CSV files")
    parser.add_argument("--subset", default="valid", help="data subset to run on (default valid)")
    parser.add_argument("--tokens", type=int, default=2000, help="source tokens to run on (default 2000)")
    parser.add_argument("--points", type=int, default=POINTS_PER_PANEL,
                        help=f"points per S-curve panel (default {POINTS_PER_PANEL})")
    args = parser.parse_args(argv)
    try:
        return plot_norms(args.checkpoint, args.data, args.out_dir, args.subset, args.tokens, args.points)
    except NormplugError as error:
        sys.exit(f"plot_norms.sh: error: {error}")


if __name__ == "__main__":
    main(sys.argv[1:])
