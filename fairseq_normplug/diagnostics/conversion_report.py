"""The report of a norm conversion (``<OUT>.report.json`` and ``.report.md``): the dev numbers
of each stage, and the fit of every converted norm site."""
import json
from typing import List

from fairseq_normplug.atomic_files import write_text_atomic
from fairseq_normplug.experiments.portable_paths import shown_path


def _num(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _affine_label(fit: dict) -> str:
    if fit.get("beta_refitted"):
        return "joint fit"
    return "gamma refitted" if fit["gamma_refitted"] else "copied"


def stage_table(stages: List[dict]) -> List[str]:
    """The markdown rows of a report's dev numbers, one row per stage."""
    return ["| stage | dev loss | dev nll loss | dev BLEU |", "| --- | ---: | ---: | ---: |"] + [
        f"| {stage['stage']} | {_num(stage['loss'])} | {_num(stage['nll_loss'])} | {_num(stage.get('bleu'), 2)} |"
        for stage in stages]


def write_report(out: str, report: dict, markdown: str):
    """``<OUT>.report.json`` and ``.report.md`` (atomically); returns their paths."""
    json_path, md_path, _ = report_paths(out)
    write_text_atomic(json_path, json.dumps(report, indent=2) + "\n")
    write_text_atomic(md_path, markdown)
    return json_path, md_path


def render_markdown(report: dict) -> str:
    """The report's tables: dev numbers per stage, then the fit of every norm site."""
    lines = [f"# Conversion of {shown_path(report['checkpoint'])} to {report['to']}", "",
             f"Dev set of {shown_path(report['data'])}; calibration ({report.get('calibration', 'per-norm')}, "
             f"gamma/beta {report.get('affine', 'gamma')}) on {report['calibration_tokens']} training "
             f"tokens; dev BLEU tokenized, beam {report['generation']['beam']}.", "",
             *stage_table(report["stages"])]
    verdict = "beats" if report["calibration_beats_naive"] else "does NOT beat"
    lines += ["", f"Calibration {verdict} the naive swap on dev loss.", "",
              "| norm | input std | 1/std | fitted alpha | gamma/beta | MSE naive | MSE calibrated | "
              "MSE / Var(LN output) |", "| --- | ---: | ---: | ---: | :---: | ---: | ---: | ---: |"]
    for name, fit in report["fits"].items():
        lines.append(f"| {name} | {fit['in_std']:.3g} | {1 / fit['in_std']:.3g} | {fit['alpha']:.3g} | "
                     f"{_affine_label(fit)} | {fit['naive_mse']:.3g} | "
                     f"{fit['mse']:.3g} | {fit['mse'] / max(fit['out_var'], 1e-12):.3g} |")
    return "\n".join(lines) + "\n"


def report_paths(out: str):
    stem = out[:-3] if out.endswith(".pt") else out
    return f"{stem}.report.json", f"{stem}.report.md", f"{stem}.finetune"
