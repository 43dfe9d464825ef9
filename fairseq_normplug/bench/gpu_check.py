"""GPU acceptance run: every GPU-specific claim of the plugin checked in one command, in
under 8 minutes on one GPU, with a JSON and a Markdown report (see docs/gpu_check.md).

    python -m fairseq_normplug.bench.gpu_check [--out results/gpu_check.md] [--budget-s 450]
        [--sections norm_paths,train_half,generate,bench_norms,bench_train]
    python -m fairseq_normplug.bench.gpu_check --device cpu --size tiny ...   (CPU test mode)

Sections, each a list of checks with status (pass, fail, timeout, skipped) and numbers:

* ``norm_paths``: every norm (ScaleNorm, RMSNorm, DyT with tanh, hardtanh and sigmoid) in
  float32, bfloat16 and float16: the fast path's output and gradients (input and every
  parameter) against the module's ``reference`` formula computed in float32 on the same
  values, within a tolerance per dtype; on a GPU the fast path must be the compiled one.
* ``train_half``: ``fairseq-train`` of a d=512 6+6 model for 200 updates under ``--fp16``
  and ``--bf16`` for the paper's main rows and the DyT row: every logged loss finite, the
  last below the first (several runs share the GPU at once, ``--jobs``).
* ``generate``: ``fairseq-generate --fp16`` of the FixNorm row's checkpoint: a hypothesis
  for every test sentence, finite scores, BLEU and tokens/s.
* ``bench_norms``: ``bench/bench_norms.py`` on the GPU: each norm's time / torch's fused
  LayerNorm, forward and forward+backward, per dtype.
* ``bench_train``: ``bench/bench_train.py``: training tokens/s of the plugin with flags off,
  ScaleNorm and DyT against stock fairseq ``transformer``.

One failing check never stops the others. Every section has a share of ``--budget-s``;
what its budget does not reach is recorded as skipped (or timeout, for a killed run). Exit
status: 0 when every check passed, 1 otherwise, 2 when there is no CUDA device and
``--device cpu`` was not given (one line, nothing run).
"""
import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import torch

from fairseq_normplug.bench.bench_norms import candidates
from fairseq_normplug.bench.bench_train import prepare_data
from fairseq_normplug.bench.common import DEFAULT_RESULTS, machine_line, markdown_table, write_results
from fairseq_normplug.command_start import run_command
from fairseq_normplug.modules import fused
from fairseq_normplug.bench.check_report import Deadline, Report, guarded
from fairseq_normplug.bench.gpu_check_training import (  # noqa: F401 (gpu_check.judge_training, ...)
    FIXNORM_ROW, PRECISION_FLAGS, ROWS, judge_generation, judge_training, run_generate, run_trainings, train_command,
)

SECTIONS = ["norm_paths", "train_half", "generate", "bench_norms", "bench_train"]
#: share of --budget-s per section; norm_paths runs while train_half's runs train
#: (the rest, about 16%, is left for data preparation, start-up and the report)
SHARES = {"norm_paths": 0.2, "train_half": 0.4, "generate": 0.06,
          "bench_norms": 0.14, "bench_train": 0.24}
#: (values, gradients) tolerance, max |fast - reference| / max |reference|, per dtype
TOLERANCE = {"float32": (1e-5, 1e-4), "bfloat16": (1.6e-2, 3.2e-2), "float16": (2e-3, 4e-3)}
DTYPES = ["float32", "bfloat16", "float16"]
SIZES = {
    # one H200: a d=512 6+6 model (transformer_normplug = transformer base)
    "full": dict(norm_shape=(64, 64, 512), arch="transformer_normplug", rows=list(ROWS), updates=200, lr=5e-4,
                 max_tokens=4096, log_interval=20, train_pairs=20000,
                 # the width norm_paths compiled for: inductor's cache spares recompiling
                 bench_norms=["--reps", "50", "--rounds", "1", "--shapes", "64x64x512,1x64x512"],
                 bench_train=["--variants", "stock,off,scalenorm,dyt", "--reps", "1",
                              "--max-update", "80", "--skip-updates", "20",
                              "--log-interval", "10", "--max-tokens", "8192"]),
    # CPU test mode: the same logic at toy sizes
    "tiny": dict(norm_shape=(3, 2, 16), arch="transformer_normplug_tiny",
                 rows=["postnorm-layernorm", FIXNORM_ROW], updates=8, lr=2e-3,
                 max_tokens=1200, log_interval=2, train_pairs=200,
                 bench_norms=["--reps", "2", "--rounds", "1", "--shapes", "4x2x16"],
                 bench_train=["--variants", "stock,off", "--reps", "1", "--max-update", "3",
                              "--skip-updates", "1", "--log-interval", "1",
                              "--max-tokens", "300"]),
}


# ---------------------------------------------------------------------------- norm_paths

def relative_error(fast: torch.Tensor, reference: torch.Tensor) -> float:
    fast, reference = fast.double(), reference.double()
    return float((fast - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def check_norm(name: str, module: torch.nn.Module, dtype: torch.dtype, shape, device) -> Dict:
    """Errors of ``module``'s fast path in ``dtype`` against its reference in float32."""
    torch.manual_seed(0)
    module = module.to(device=device, dtype=dtype)
    with torch.no_grad():  # parameters away from their init, so every gradient matters
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    reference = copy.deepcopy(module).float()
    x = (3 * torch.randn(shape, device=device)).to(dtype).requires_grad_()
    dy = torch.randn(shape, device=device).to(dtype)
    xr = x.detach().float().requires_grad_()
    params = [p for p in module.parameters() if p.requires_grad]
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    out = module(x)
    grads = torch.autograd.grad(out, [x] + params, dy)
    ref_out = reference.reference(xr)
    ref_grads = torch.autograd.grad(ref_out, [xr] + ref_params, dy.float())
    value_error = relative_error(out, ref_out)
    grad_error = max(relative_error(g, r) for g, r in zip(grads, ref_grads))
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    return {"path": module.fast_path(x.detach()), "value_err": value_error,
            "grad_err": grad_error, "finite": finite, "out_dtype": str(out.dtype)[6:]}


def run_norm_paths(report: Report, cfg: Dict, device: torch.device, deadline: Deadline) -> None:
    shape = cfg["norm_shape"]
    for dtype_name in DTYPES:
        for name, module, _ in candidates(shape[-1], reference=False, eager=False):
            if name == "layernorm":
                continue
            check = f"{name} {dtype_name}"
            if deadline.left() <= 0:
                report.add("norm_paths", check, "skipped", detail="section budget spent")
                continue

            def one(name=name, module=module, check=check, dtype_name=dtype_name):
                start = time.time()
                numbers = check_norm(name, module, getattr(torch, dtype_name), shape, device)
                value_tol, grad_tol = TOLERANCE[dtype_name]
                problems = []
                if not numbers["finite"]:
                    problems.append("non-finite output or gradient")
                if numbers["value_err"] > value_tol:
                    problems.append(f"value error {numbers['value_err']:.2e} > {value_tol:g}")
                if numbers["grad_err"] > grad_tol:
                    problems.append(f"gradient error {numbers['grad_err']:.2e} > {grad_tol:g}")
                if numbers["out_dtype"] != dtype_name:
                    problems.append(f"output dtype {numbers['out_dtype']}")
                # norms without a fast path (Derf, DyISRU) run their plain formula anywhere
                if device.type == "cuda" and numbers["path"] not in ("compiled", "plain"):
                    failed = ", ".join(fused.failed_kernels()) or "none failed"
                    problems.append(f"ran {numbers['path']}, not compiled (failed kernels: "
                                    f"{failed})")
                report.add("norm_paths", check, "fail" if problems else "pass", numbers,
                           "; ".join(problems), time.time() - start)

            guarded(report, "norm_paths", check, one)


# ---------------------------------------------------------------------------- train_half


# ---------------------------------------------------------------------------- generate


# ---------------------------------------------------------------------------- benchmarks

def run_benchmark(module: str, argv: List[str], out: str, deadline: Deadline) -> Dict:
    """Run ``python -m module argv --out out`` within the deadline; its JSON results."""
    proc = run_command([sys.executable, "-m", module, *argv, "--out", out], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=max(1, deadline.left()),
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1:] or [""]
        raise RuntimeError(f"{module} exit status {proc.returncode}: {tail[0][-300:]}")
    with open(os.path.splitext(out)[0] + ".json") as f:
        return json.load(f)


def norm_ratios(result: Dict) -> Dict[str, Dict]:
    """Per norm of one bench_norms result: fwd and fwd+bwd time / LayerNorm's, and its path."""
    ratios = result["ratios"]
    return {name: {"fwd/LN": round(ratios[f"{name}|fwd|LN"], 3),
                   "f+b/LN": round(ratios[f"{name}|fwd+bwd|LN"], 3), "path": path}
            for name, path in result["paths"].items() if name != "layernorm"}


def run_bench_norms(report: Report, cfg: Dict, device: torch.device, workdir: str,
                    deadline: Deadline) -> None:
    out = os.path.join(workdir, "bench_norms.md")
    data = run_benchmark("fairseq_normplug.bench.bench_norms",
                         ["--device", device.type, "--dtypes", ",".join(DTYPES),
                          *cfg["bench_norms"]], out, deadline)
    for result in data["results"]:
        shape = "x".join(map(str, result["shape"]))
        for name, numbers in norm_ratios(result).items():
            report.add("bench_norms", f"{name} {shape} {result['dtype']}", "pass", numbers)


def run_bench_train(report: Report, cfg: Dict, device: torch.device, workdir: str,
                    deadline: Deadline, corpus: Optional[str] = None) -> None:
    """``bench/bench_train.py`` on ``corpus`` (the check's binarized corpus; without one,
    its synthetic corpus of ``cfg["train_pairs"]`` pairs in ``workdir``)."""
    out = os.path.join(workdir, "bench_train.md")
    source = ["--data", corpus] if corpus else ["--train-pairs", str(cfg["train_pairs"])]
    data = run_benchmark("fairseq_normplug.bench.bench_train",
                         ["--device", device.type, "--workdir", workdir, *source,
                          *cfg["bench_train"]], out, deadline)
    stock = data["runs"]["stock"]
    for variant, runs in data["runs"].items():
        ratio = [r["wps"] / s["wps"] for r, s in zip(runs, stock)]
        report.add("bench_train", variant, "pass",
                   {"tok_s": round(sorted(r["wps"] for r in runs)[len(runs) // 2]),
                    "vs_stock": round(sorted(ratio)[len(ratio) // 2], 3)})


# ---------------------------------------------------------------------------- the run

def run(args) -> Report:
    cfg = SIZES[args.size]
    device = torch.device(args.device)
    budget = args.budget_s
    workdir = os.path.abspath(args.workdir)
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    sections = args.sections.split(",")
    report = Report()
    precisions = args.precisions.split(",")

    data = args.data
    if data is None and ({"train_half", "generate"} & set(sections)):
        data = prepare_data(workdir, cfg["train_pairs"])  # bench_train trains on it too

    trainer = None
    checkpoint = os.path.join(workdir, "checkpoints", f"{FIXNORM_ROW}-{precisions[0]}",
                              "checkpoint_last.pt")
    # never resume from (or decode) an earlier run's checkpoint
    shutil.rmtree(os.path.dirname(checkpoint), ignore_errors=True)
    if "train_half" in sections or "generate" in sections:
        jobs = []
        for precision in precisions:
            for row in cfg["rows"] if "train_half" in sections else [FIXNORM_ROW]:
                name = f"{row} --{precision}" if precision != "fp32" else row
                keep = row == FIXNORM_ROW and precision == precisions[0]
                jobs.append({"name": name, "updates": cfg["updates"],
                             "log": os.path.join(workdir, "logs", f"{row}-{precision}.log"),
                             "cmd": train_command(data, row, precision, cfg, device,
                                                  os.path.dirname(checkpoint) if keep else None)})
        if "generate" in sections:  # the run generate needs goes first
            jobs.sort(key=lambda job: job["log"] != os.path.join(
                workdir, "logs", f"{FIXNORM_ROW}-{precisions[0]}.log"))
        train_deadline = Deadline(budget * SHARES["train_half"])
        trainer = threading.Thread(target=guarded, args=(
            report, "train_half", "section",
            lambda: run_trainings(report, jobs, args.jobs, train_deadline)))
        trainer.start()
    if "norm_paths" in sections:
        guarded(report, "norm_paths", "section",
                lambda: run_norm_paths(report, cfg, device, Deadline(budget * SHARES["norm_paths"])))
    if trainer is not None:
        trainer.join()
    if "generate" in sections:
        guarded(report, "generate", "section",
                lambda: run_generate(report, data, checkpoint, args.generate_precision, device,
                                     Deadline(budget * SHARES["generate"])))
    if "bench_norms" in sections:
        deadline = Deadline(budget * SHARES["bench_norms"])
        guarded(report, "bench_norms", "section",
                lambda: run_bench_norms(report, cfg, device, workdir, deadline))
    if "bench_train" in sections:
        deadline = Deadline(budget * SHARES["bench_train"])
        guarded(report, "bench_train", "section",
                lambda: run_bench_train(report, cfg, device, workdir, deadline, data))
    return report


def markdown(report: Report, meta: Dict) -> str:
    counts = {s: sum(c["status"] == s for c in report.checks)
              for s in ("pass", "fail", "timeout", "skipped")}
    lines = [
        "# GPU acceptance run (scripts/gpu_check.sh)", "",
        f"{meta['machine']}; device {meta['device']}, size {meta['size']}, "
        f"{meta['total_s']:.0f} s of a {meta['budget_s']:.0f} s budget.", "",
        f"**{'PASS' if report.passed() else 'FAIL'}**: " + ", ".join(
            f"{n} {s}" for s, n in counts.items() if n) + ". See docs/gpu_check.md.",
    ]
    for section in SECTIONS:
        checks = [c for c in report.checks if c["section"] == section]
        if not checks:
            continue
        rows = [[c["name"], c["status"],
                 ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in c["numbers"].items()),
                 c["detail"], f"{c['seconds']:.1f}"] for c in checks]
        lines += ["", f"## {section}", "",
                  markdown_table(["check", "status", "numbers", "detail", "s"], rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda",
                        help="cuda (default; refuses without a CUDA device) or cpu (test mode)")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="full (d=512 6+6, default on cuda) or tiny (default on cpu)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of %(default)s")
    parser.add_argument("--precisions", default=None,
                        help="training precisions (default fp16,bf16 on cuda; fp32 on cpu, "
                             "where fairseq trains in float32 only)")
    parser.add_argument("--generate-precision", default=None,
                        help="fp16 (default on cuda) or fp32 (default on cpu)")
    parser.add_argument("--budget-s", type=float, default=450,
                        help="time budget of the whole run, shared out by section")
    parser.add_argument("--jobs", type=int, default=None,
                        help="training runs at once (default 8 on cuda, 1 on cpu)")
    parser.add_argument("--data", default=None,
                        help="binarized corpus (default: a synthetic one, made in --workdir)")
    parser.add_argument("--workdir", default=os.path.join(
        os.path.dirname(DEFAULT_RESULTS), "runs", "gpu_check"))
    parser.add_argument("--out", default=os.path.join(DEFAULT_RESULTS, "gpu_check.md"))
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, "
              f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU build'}); "
              f"run it on a GPU machine, or pass --device cpu for the CPU test mode",
              file=sys.stderr)
        return 2
    args.size = args.size or ("full" if on_gpu else "tiny")
    args.precisions = args.precisions or ("fp16,bf16" if on_gpu else "fp32")
    bad = [p for p in args.precisions.split(",") + [args.generate_precision or "fp32"]
           if p not in PRECISION_FLAGS]
    if bad:
        parser.error(f"unknown precisions {bad}; choose from {', '.join(PRECISION_FLAGS)}")
    args.generate_precision = args.generate_precision or ("fp16" if on_gpu else "fp32")
    args.jobs = args.jobs or (8 if on_gpu else 1)
    start = time.time()
    report = run(args)
    meta = {"machine": machine_line(), "device": args.device, "size": args.size,
            "budget_s": args.budget_s, "total_s": time.time() - start,
            "args": vars(args), "status": "pass" if report.passed() else "fail"}
    write_results(args.out, markdown(report, meta), {**meta, "checks": report.checks})
    print(markdown(report, meta))
    print(f"written to {args.out} and {os.path.splitext(args.out)[0]}.json")
    return 0 if report.passed() else 1


if __name__ == "__main__":
    sys.exit(main())
