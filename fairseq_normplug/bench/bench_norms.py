"""Micro-benchmark of every norm the plugin offers against torch's fused ``layer_norm``.

    python -m fairseq_normplug.bench.bench_norms [--shapes 64x64x512,128x32x1024,1x64x512]
        [--reps 100] [--dtypes float32] [--device cpu|cuda] [--reference] [--eager]
        [--rounds 3] [--out results/bench_norms.md]

For each shape (time x batch x dim, as a Transformer layer sees it; ``1xBxD`` is one
decoding step) and dtype it times, interleaved (every repetition runs every candidate once,
in rotating order) and reports medians of:

* ``fwd``: the forward alone, without autograd (inference, decoding);
* ``fwd+bwd``: forward, then the gradients of input and parameters for a given output
  gradient (training).

Candidates: ``layernorm`` (``torch.nn.LayerNorm``, what fairseq's LayerNorm is on CPU: the
baseline), the plugin's ``scalenorm``, ``rmsnorm``, ``dyt`` (tanh), ``dyt-hardtanh`` and
``dyt-sigmoid`` as their modules run them (default fast path; the ``path`` column says
which), with ``--reference`` the plain reference formulas (``*-ref``), with ``--eager`` the
fast path with native kernels and compilation off (``*-eager``, what
``NORMPLUG_NATIVE=0 NORMPLUG_COMPILE=0`` gives). Ratios ``/LN`` divide by layernorm's
median of the same run. ``/floor`` divides by the memory-bandwidth floor, measured in the
same run: for ``fwd`` a plain copy of the input (read x, write y: the least any norm must
move), for ``fwd+bwd`` that copy plus ``x + dy`` into a new tensor (read x and dy, write
dx). ``first call`` is the time of the very first forward+backward, compilation included.

The whole benchmark runs ``--rounds`` times, each in a fresh process: on a shared machine
the ratios move by 10-20% from one process to the next (which tensors stay in the last-level
cache, where the allocator put them), far more than between repetitions of one process. The
table shows the median over rounds of each time and ratio, and the range of ``f+b /LN``.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from fairseq_normplug.bench.common import (
    DEFAULT_RESULTS, OtherProcesses, load_average, load_warning, machine_line, markdown_table,
    median, publish, steady_allocator_env,
)
from fairseq_normplug.command_start import run_command
from fairseq_normplug.modules import fused, native
from fairseq_normplug.modules.derf import Derf
from fairseq_normplug.modules.dyisru import DyISRU
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh
from fairseq_normplug.modules.rms_norm import RMSNorm
from fairseq_normplug.modules.scale_norm import ScaleNorm

DEFAULT_SHAPES = "64x64x512,128x32x1024,1x64x512"


def candidates(dim: int, reference: bool, eager: bool) -> List[Tuple[str, nn.Module, Callable]]:
    """(name, module, forward function) of every norm to time."""
    plugin = [
        ("scalenorm", ScaleNorm(dim)),
        ("rmsnorm", RMSNorm(dim)),
        ("dyt", DynamicTanh(dim)),
        ("dyt-hardtanh", DynamicTanh(dim, squash="hardtanh")),
        ("dyt-sigmoid", DynamicTanh(dim, squash="sigmoid")),
    ]
    layernorm = nn.LayerNorm(dim)
    out = [("layernorm", layernorm, layernorm)]
    out += [(name, module, module) for name, module in plugin]
    # norms without a fast path: their plain formula through autograd
    out += [(name, module, module) for name, module in (("derf", Derf(dim)), ("dyisru", DyISRU(dim)))]
    if eager:
        out += [(f"{name}-eager", module, _eager(module)) for name, module in plugin]
    if reference:
        out += [(f"{name}-ref", module, module.reference) for name, module in plugin]
    return out


def _eager(module: nn.Module) -> Callable:
    def forward(x):
        with fused.disable("native", "compiled"):
            return module(x)
    return forward


def _path(name: str, module: nn.Module, x: torch.Tensor) -> str:
    if name == "layernorm":
        return "aten"
    if name.endswith("-ref"):
        return "reference"
    if name.endswith("-eager"):
        return "eager"
    return module.fast_path(x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_shape(shape, dtype, device, reps, reference, eager, seed=0) -> Dict:
    """Medians (seconds) of every candidate and both floors for one shape and dtype."""
    torch.manual_seed(seed)
    dim = shape[-1]
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=dtype)
    xd = x.detach()
    cands = []
    for name, module, forward in candidates(dim, reference, eager):
        module.to(device=device, dtype=dtype)
        params = [p for p in module.parameters() if p.requires_grad]
        cands.append((name, module, forward, params))

    def timed(fn):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    jobs: Dict[Tuple[str, str], Callable] = {
        ("floor", "fwd"): lambda: torch.empty_like(xd).copy_(xd),
        ("floor", "fwd+bwd"): lambda: (torch.empty_like(xd).copy_(xd), torch.add(xd, grad)),
    }
    first_call = {}
    for name, module, forward, params in cands:
        def fwd(forward=forward):
            with torch.no_grad():
                forward(xd)

        def fwd_bwd(forward=forward, params=params):
            torch.autograd.grad(forward(x), [x] + params, grad)

        first_call[name] = timed(fwd_bwd)
        fwd()
        jobs[(name, "fwd")] = fwd
        jobs[(name, "fwd+bwd")] = fwd_bwd
    times = {key: [] for key in jobs}
    keys = list(jobs)
    for rep in range(reps):
        shift = rep % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].append(timed(jobs[key]))
    medians = {f"{n}|{m}": median(v) for (n, m), v in times.items()}
    return {
        "shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "device": str(device),
        "medians_s": medians, "ratios": ratios(medians), "first_call_s": first_call,
        "paths": {name: _path(name, module, xd) for name, module, _, _ in cands},
    }


def ratios(medians: Dict[str, float]) -> Dict[str, float]:
    """``NAME|MODE|LN`` and ``NAME|MODE|floor``: each median divided by layernorm's and by
    the floor's of the same mode."""
    out = {}
    for key, t in medians.items():
        name, mode = key.split("|")
        out[f"{key}|LN"] = t / medians[f"layernorm|{mode}"]
        out[f"{key}|floor"] = t / medians[f"floor|{mode}"]
    return out


def combine_rounds(rounds: List[List[Dict]]) -> List[Dict]:
    """One result per shape from the same shape's results of every round: medians over
    rounds of the times and of the ratios, and each ratio's range over rounds."""
    combined = []
    for per_round in zip(*rounds):
        result = dict(per_round[0])
        for field in ("medians_s", "first_call_s", "ratios"):
            result[field] = {k: median([r[field][k] for r in per_round]) for k in result[field]}
        result["ratio_ranges"] = {k: [min(r["ratios"][k] for r in per_round),
                                      max(r["ratios"][k] for r in per_round)]
                                  for k in result["ratios"]}
        result["rounds"] = len(per_round)
        combined.append(result)
    return combined


def table(result: Dict) -> str:
    med, ratio = result["medians_s"], result["ratios"]
    ranges = result.get("ratio_ranges")
    rows = []
    for name, path in result["paths"].items():
        row = [name, path]
        for mode in ("fwd", "fwd+bwd"):
            key = f"{name}|{mode}"
            row += [f"{med[key] * 1e3:.3f}", f"{ratio[key + '|LN']:.2f}",
                    f"{ratio[key + '|floor']:.2f}"]
        if ranges:
            low, high = ranges[f"{name}|fwd+bwd|LN"]
            row.append(f"{low:.2f}-{high:.2f}")
        row.append(f"{result['first_call_s'][name]:.2f}")
        rows.append(row)
    rows.append(["(copy floor)", "-", f"{med['floor|fwd'] * 1e3:.3f}", "", "1.00",
                 f"{med['floor|fwd+bwd'] * 1e3:.3f}", "", "1.00"] + [""] * (2 if ranges else 1))
    shape = "x".join(map(str, result["shape"]))
    header = ["norm", "path", "fwd ms", "fwd /LN", "fwd /floor", "fwd+bwd ms", "f+b /LN",
              "f+b /floor"] + (["f+b /LN range"] if ranges else []) + ["first call s"]
    return f"### {shape} {result['dtype']} on {result['device']}\n\n" + markdown_table(header, rows)


def run_rounds(argv: List[str], rounds: int) -> List[List[Dict]]:
    """The benchmark's results from ``rounds`` fresh processes, one after the other."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            out = os.path.join(tmp, f"round{i}.md")
            start = time.time()
            proc = run_command(
                [sys.executable, "-m", "fairseq_normplug.bench.bench_norms", *argv,
                 "--rounds", "1", "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"bench_norms: round {i + 1} failed:\n{proc.stderr[-2000:]}")
            with open(os.path.splitext(out)[0] + ".json") as f:
                results.append(json.load(f)["results"])
            print(f"round {i + 1}/{rounds} done in {time.time() - start:.0f} s", flush=True)
    return results


def parse_shapes(text: str) -> List[Tuple[int, ...]]:
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated TxBxD shapes (default %(default)s)")
    parser.add_argument("--reps", type=int, default=100, help="timed repetitions (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated; default float32 on CPU, "
                             "float32,bfloat16,float16 on GPU")
    parser.add_argument("--reference", action="store_true",
                        help="also time the plain reference formulas (*-ref)")
    parser.add_argument("--eager", action="store_true",
                        help="also time the fast path with compilation disabled (*-eager)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice; 1 gives steadier "
                             "ratios when other processes share the CPUs)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="fresh processes to run the whole benchmark in; the table shows "
                             "medians over rounds and the range of f+b /LN (default %(default)s)")
    parser.add_argument("--out", default=os.path.join(DEFAULT_RESULTS, "bench_norms.md"))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        parser.error(f"--rounds and --reps must be at least 1, got {args.rounds} and {args.reps}")
    steady_allocator = steady_allocator_env() or args.rounds > 1  # rounds: child processes
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtypes = args.dtypes or ("float32" if device.type == "cpu" else "float32,bfloat16,float16")
    load_before = load_average()
    others = OtherProcesses()
    if args.rounds == 1:
        results = [
            bench_shape(shape, getattr(torch, dtype), device, args.reps, args.reference,
                        args.eager)
            for shape, dtype in itertools.product(parse_shapes(args.shapes), dtypes.split(","))
        ]
    else:
        results = combine_rounds(run_rounds(argv, args.rounds))
    other_share = others.share()
    warning = load_warning(other_share)
    head = [
        "# Norm layers against torch's fused layer_norm",
        "",
        f"{machine_line()}; medians of {args.reps} interleaved repetitions"
        f"{f', then over {args.rounds} rounds (fresh processes)' if args.rounds > 1 else ''}; "
        f"native operators {'on' if fused.native_enabled() else 'off'} (NORMPLUG_NATIVE), "
        f"compilation {'on' if fused.compile_enabled() else 'off'} "
        f"(NORMPLUG_COMPILE); load average {load_before:.2f} at start; other processes "
        f"used {100 * (other_share or 0):.0f}% of the CPUs during the run.",
        "",
        "`/LN`: time divided by layernorm's in the same run (below 1 = faster). `/floor`: "
        "time divided by a plain copy of the same bytes (fwd: copy x; fwd+bwd: copy x, "
        "then x + dy; 1.00 = the memory-bandwidth limit). `path`: native (the plugin's C++ "
        "kernels), compiled (torch.compile of the plugin's kernels), eager (the same, op by "
        "op), aten (torch's own kernel) or reference (plain formula). `f+b /LN range`: the "
        "lowest and highest f+b /LN over the rounds. See docs/speed.md.",
    ]
    unavailable = ([f"native operators ({native.failure()})"] if native.failure() else []) + [
        f"torch.compile of {name}" for name in fused.failed_kernels()]
    if unavailable:
        head += ["", "NOTE: unavailable here, replaced by the next path: "
                     f"{'; '.join(unavailable)}."]
    if not steady_allocator:
        head += ["", "NOTE: glibc may return freed memory to the kernel between calls; the "
                     "page faults that follow add noise. Rounds in child processes (--rounds "
                     "2 or more) or MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ set before "
                     "start (see bench/common.py) prevent it."]
    if warning:
        head += ["", warning]
    text = "\n".join(head) + "\n\n" + "\n\n".join(table(r) for r in results) + "\n"
    publish(args.out, text, {"machine": machine_line(), "reps": args.reps,
                             "rounds": args.rounds, "load_average": [load_before, load_average()],
                             "other_cpu_share": other_share, "results": results})
    return text


if __name__ == "__main__":
    main()
