"""End-to-end training throughput of ``fairseq-train``: stock ``transformer`` against the
plugin with its flags off and with each norm variant.

    python -m fairseq_normplug.bench.bench_train [--variants stock,off,scalenorm,rmsnorm,dyt]
        [--reps 3] [--max-update 120] [--skip-updates 20] [--train-pairs 20000]
        [--max-tokens 1024] [--out results/bench_train.md]

Every variant trains the same model size (the ``transformer_normplug_cpu`` preset: d=256,
FFN 1024, 4 heads, 3+3 layers, tied target embeddings; stock ``transformer`` gets the same
sizes as flags) on the same binarized synthetic corpus with the same seed, optimizer and
batch size. The runs alternate (rep 1: every variant once, in rotating order; rep 2: ...),
so slow phases of a shared machine hit all variants alike.

Throughput is target tokens per second over the steady state: the sum of fairseq's
``train_inner`` words (``wpb`` x updates) over the sum of their times, after the first
``--skip-updates`` updates (start-up and kernel compilation; reported separately as
``start s``: process start to the first logged update). ``peak RSS`` is the process's
maximum resident memory (CPU memory; on a GPU the device memory is not covered). Ratios
divide by stock's figure of the same repetition, then take the median over repetitions.
"""
import argparse
import glob
import os
import subprocess
import time
from typing import Dict, List

import torch

from fairseq_normplug.bench.common import (
    DEFAULT_RESULTS, OtherProcesses, load_average, load_warning, machine_line, markdown_table,
    median, publish, steady_allocator_env,
)
from fairseq_normplug.command_start import run_command, start_command
from fairseq_normplug.experiments.training_log import json_record
from fairseq_normplug.fairseq_commands import fairseq_command, program_path, USER_DIR_FLAGS

SIZE_FLAGS = [
    "--encoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
    "--encoder-attention-heads", "4", "--encoder-layers", "3",
    "--decoder-embed-dim", "256", "--decoder-ffn-embed-dim", "1024",
    "--decoder-attention-heads", "4", "--decoder-layers", "3",
    "--share-decoder-input-output-embed",
]
PLUGIN = ["--arch", "transformer_normplug_cpu", *USER_DIR_FLAGS]
VARIANTS = {
    "stock": ["--arch", "transformer", *SIZE_FLAGS],
    "off": PLUGIN,
    "scalenorm": PLUGIN + ["--norm-type", "scalenorm"],
    "rmsnorm": PLUGIN + ["--norm-type", "rmsnorm"],
    "dyt": PLUGIN + ["--norm-type", "dyt"],
    "prenorm": PLUGIN + ["--prenorm"],
    "prenorm-scalenorm": PLUGIN + ["--prenorm", "--norm-type", "scalenorm"],
    "prenorm-rmsnorm": PLUGIN + ["--prenorm", "--norm-type", "rmsnorm"],
    "prenorm-dyt": PLUGIN + ["--prenorm", "--norm-type", "dyt"],
}
#: Mix-LN at the benchmark's 3 layers: rho 0.34 gives one PostNorm layer per stack, as the
#: table's 0.25 does at 6 (docs/beyond.md); 0.25 would give none
MIX_AT_THREE_LAYERS = ["--mix-ln-ratio", "0.34"]


def beyond_variants() -> Dict[str, List[str]]:
    """{run-folder slug: model flags} of the rows of the beyond table
    (configs/experiments/beyond.json), for their speed and memory against stock
    (docs/speed.md): the depth sweep aside (the same modules, more layers), each set of model
    flags once, PostNorm and PreNorm + LayerNorm being ``off`` and ``prenorm``."""
    from fairseq_normplug.experiments.configs import load_table
    from fairseq_normplug.experiments.configs import slug
    from fairseq_normplug.models.placements import training_task

    variants, seen = {}, [[], ["--prenorm"]]
    for row in load_table("beyond").rows:
        if "--encoder-layers" in row.model or row.model in seen:
            continue
        seen.append(row.model)
        extra = MIX_AT_THREE_LAYERS if row.model == ["--norm-placement", "mix"] else []
        task = training_task(row.model)  # a design that trains under one task only (nGPT)
        variants[slug(row.name)] = row.model + extra + (["--task", task] if task else [])
    return variants


BEYOND_VARIANTS = beyond_variants()
VARIANTS.update({name: PLUGIN + flags for name, flags in BEYOND_VARIANTS.items()})
VARIANTS["stock-prenorm"] = VARIANTS["stock"] + ["--encoder-normalize-before", "--decoder-normalize-before"]
DEFAULT_VARIANTS = "stock,off,scalenorm,rmsnorm,dyt"
#: ``--variants beyond``: stock (PostNorm and PreNorm), then every beyond row (PostNorm and PreNorm
#: + LayerNorm are ``off`` and ``prenorm``)
BEYOND = ",".join(["stock", "stock-prenorm", "off", "prenorm", *BEYOND_VARIANTS])


def prepare_data(workdir: str, pairs: int) -> str:
    """Synthetic corpus of ``pairs`` training pairs, binarized with a joined dictionary
    (kept in ``workdir`` and reused by later runs)."""
    from fairseq_normplug.synthetic_corpus import write_corpus

    dest = os.path.join(workdir, f"data-bin-{pairs}")
    if os.path.exists(os.path.join(dest, "train.src-tgt.src.bin")):
        return dest
    raw = write_corpus(os.path.join(workdir, f"raw-{pairs}"), train=pairs, valid=100, test=100)
    run_command([
        program_path("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--testpref",
        f"{raw}/test", "--destdir", dest, "--joined-dictionary", "--workers", "1",
    ], stdout=subprocess.PIPE, stderr=subprocess.PIPE).check_returncode()
    return dest


def train_command(data: str, variant: str, args) -> List[str]:
    """The fairseq-train command of ``variant``: the benchmark's training flags, then the
    variant's (stock fairseq without the plugin; a plugin variant names ``--user-dir``)."""
    device = ["--cpu"] if args.device == "cpu" else []
    return fairseq_command(
        "fairseq-train", data, *device,
        "--task", "translation", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
        "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--clip-norm", "1.0", "--max-tokens", str(args.max_tokens), "--seed", "1",
        "--max-update", str(args.max_update), "--log-format", "json", "--log-interval",
        str(args.log_interval), "--disable-validation", "--no-save", "--num-workers", "0",
        *VARIANTS[variant],  # last: a variant's --task replaces the benchmark's
        plugin=False)


def run_once(cmd: List[str], skip_updates: int, threads: int = 0) -> Dict:
    """Run one training; parse its json log. Returns tokens/s, peak RSS, start-up time and
    the share of its CPUs the process got (well below 1: other processes competed)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    start = time.time()
    proc = start_command(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    words = seconds = 0.0
    first_log = None
    last_update = 0
    lines = []
    for line in proc.stdout:
        lines.append(line)
        record = json_record(line, "train_inner")
        if record is None:
            continue
        update = int(record["num_updates"])
        if first_log is None:
            first_log = time.time() - start
        if last_update >= skip_updates:
            ups = update - last_update
            words += float(record["wpb"]) * ups
            seconds += float(record["wpb"]) * ups / float(record["wps"])
        last_update = update
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0 or seconds == 0:
        raise RuntimeError(f"training failed or logged nothing past update {skip_updates}: "
                           f"{' '.join(cmd)}\n{''.join(lines[-30:])}")
    total = time.time() - start
    cpus = threads or torch.get_num_threads()
    return {"wps": words / seconds, "peak_rss_mb": usage.ru_maxrss / 1024,
            "start_s": first_log, "total_s": total, "updates": last_update,
            "cpu_share": (usage.ru_utime + usage.ru_stime) / (total * cpus)}


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated, from {', '.join(VARIANTS)}; or 'beyond': {BEYOND}")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions")
    parser.add_argument("--max-update", type=int, default=120)
    parser.add_argument("--skip-updates", type=int, default=20,
                        help="updates left out of the throughput (start-up, compilation)")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--train-pairs", type=int, default=20000,
                        help="pairs of the synthetic corpus made in --workdir (without --data)")
    parser.add_argument("--data", default=None, metavar="DIR",
                        help="a binarized translation corpus of your own (fairseq-preprocess's "
                             "output, e.g. the GPU check's) instead of the synthetic one")
    parser.add_argument("--threads", type=int, default=0,
                        help="OMP_NUM_THREADS of the training processes (default: torch's "
                             "choice; 1 is steadier when other processes share the CPUs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workdir", default=os.path.join(
        os.path.dirname(DEFAULT_RESULTS), "runs", "bench_train"),
        help="where the synthetic corpus is kept")
    parser.add_argument("--out", default=os.path.join(DEFAULT_RESULTS, "bench_train.md"))
    parser.add_argument("--also-against", default="", metavar="VARIANT[,VARIANT...]",
                        help="more reference variants, each with its own ratio columns beside stock's "
                             "(e.g. prenorm: the new designs against PreNorm + LayerNorm)")
    args = parser.parse_args(argv)
    variants = (BEYOND if args.variants == "beyond" else args.variants).split(",")
    references = ["stock", *[v for v in args.also_against.split(",") if v]]
    unknown = [v for v in variants + references if v not in VARIANTS]
    if unknown or not set(references) <= set(variants):
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}" if unknown
                     else f"variants must include stock and every --also-against variant ({', '.join(references)})")
    if args.data and not glob.glob(os.path.join(args.data, "dict.*.txt")):
        parser.error(f"--data {args.data} is not a binarized corpus (no dict.*.txt in it); give "
                     "fairseq-preprocess's --destdir, or leave --data out for the synthetic corpus")
    steady_allocator_env()  # for the training processes: same settings for every variant
    data = args.data or prepare_data(args.workdir, args.train_pairs)
    load_before = load_average()
    others = OtherProcesses()
    runs: Dict[str, List[Dict]] = {v: [] for v in variants}
    for rep in range(args.reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for variant in order:
            result = run_once(train_command(data, variant, args), args.skip_updates,
                              args.threads)
            runs[variant].append(result)
            print(f"rep {rep + 1} {variant}: {result['wps']:.0f} tok/s, "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB, start {result['start_s']:.1f} s, "
                  f"CPU share {result['cpu_share']:.2f}", flush=True)
    other_share = others.share()
    warning = load_warning(other_share)
    rows = []
    for variant in variants:
        wps = [r["wps"] for r in runs[variant]]
        ratios = []
        for reference in references:
            ratio = [r["wps"] / s["wps"] for r, s in zip(runs[variant], runs[reference])]
            rss = [r["peak_rss_mb"] / s["peak_rss_mb"] for r, s in zip(runs[variant], runs[reference])]
            ratios.append((f"{median(ratio):.3f}", f"{median(rss):.3f}"))
        rows.append([
            variant, f"{median(wps):.0f}", " ".join(f"{w:.0f}" for w in wps),
            ratios[0][0], f"{median([r['peak_rss_mb'] for r in runs[variant]]):.0f}",
            ratios[0][1], f"{median([r['start_s'] for r in runs[variant]]):.1f}",
            f"{min(r['cpu_share'] for r in runs[variant]):.2f}",
            *[value for pair in ratios[1:] for value in pair],
        ])
    header = ["variant", "tok/s (median)", "tok/s per rep", "vs stock", "peak RSS MB",
              "RSS vs stock", "start s", "min CPU share",
              *[column for reference in references[1:] for column in (f"vs {reference}", f"RSS vs {reference}")]]
    corpus = f"corpus {args.data}" if args.data else f"synthetic corpus of {args.train_pairs} pairs"
    head = [
        "# Training throughput: stock transformer vs the plugin",
        "",
        f"{machine_line()}; {args.reps} alternating repetitions of {args.max_update} updates "
        f"(--max-tokens {args.max_tokens}, d=256 3+3 layers, {corpus}), throughput over updates "
        f"{args.skip_updates + 1}-"
        f"{args.max_update}, {args.threads or torch.get_num_threads()} threads per run; "
        f"load average {load_before:.2f} at start; other processes used "
        f"{100 * (other_share or 0):.0f}% of the CPUs during the run.",
        "",
        "`tok/s`: target tokens per second, steady state. `vs stock`: median over repetitions "
        "of the ratio to stock's run of the same repetition (above 1 = faster; `vs X`: the same "
        "against variant X). `start s`: "
        "process start to the first logged update (imports, data loading, kernel "
        "compilation). `peak RSS`: maximum resident memory of the process. `min CPU share`: the "
        "lowest, over repetitions, CPU time / (wall time x threads) of a run; well below 1 "
        "means other processes took CPU time from it. See docs/speed.md.",
    ]
    if warning:
        head += ["", warning]
    text = "\n".join(head) + "\n\n" + markdown_table(header, rows) + "\n"
    publish(args.out, text, {"machine": machine_line(), "args": vars(args), "runs": runs,
                             "load_average": [load_before, load_average()],
                             "other_cpu_share": other_share})
    return text


if __name__ == "__main__":
    main()
