"""Decoding throughput of a FixNorm model against the same model without FixNorm.

    python -m fairseq_normplug.bench.bench_decode [--vocab 32000] [--arch transformer_normplug_cpu]
        [--flags=--prenorm,--scalenorm] [--batch 8] [--beam 4] [--steps 24] [--src-len 20]
        [--reps 5] [--threads 1] [--out results/bench_decode.md]

Three variants of one model (same arch, same ``--flags``, same seed, tied target embedding,
a joined dictionary of ``--vocab`` made-up words):

* ``no-fixnorm``: the flags alone;
* ``fixnorm``: the flags plus ``--fixnorm`` (the normalised V x d matrix is computed once
  and reused while decoding, ``modules/fixnorm_embedding.py``);
* ``fixnorm-uncached``: the same FixNorm model re-normalising the matrix on every call (twice
  per decoding step: target embedding and output layer), i.e. the cost the cache removes.

Each variant decodes the same random source batch with fairseq's ``SequenceGenerator``
(beam search; every hypothesis is made exactly ``--steps`` tokens long, so all variants do
the same work). The variants alternate (rep 1: each once, in rotating order; rep 2: ...)
after one warm-up round. Throughput is generated tokens (batch x steps) per second;
``vs no-fixnorm`` is the median over repetitions of the ratio to ``no-fixnorm``'s run of the
same repetition (goal for ``fixnorm``: at least 0.95), from wall time and from the process's
CPU time (steadier on a shared machine: with one torch thread it counts only this work).
"""
import argparse
import os
import tempfile
import time
from typing import Dict, List, Tuple

import torch
from fairseq import options, tasks, utils
from fairseq.data import Dictionary
from fairseq.sequence_generator import SequenceGenerator

from fairseq_normplug.bench.common import (
    DEFAULT_RESULTS, OtherProcesses, load_average, load_warning, machine_line, markdown_table,
    median, publish,
)
from fairseq_normplug.fairseq_commands import fairseq_arguments
from fairseq_normplug.modules.fixnorm_embedding import FixNormEmbedding

VARIANTS = ("no-fixnorm", "fixnorm", "fixnorm-uncached")


def write_dictionary(workdir: str, vocab: int) -> None:
    """A joined dictionary of ``vocab`` types (special symbols included) for src and tgt."""
    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}", n=vocab - i)
    for lang in ("src", "tgt"):
        d.save(os.path.join(workdir, f"dict.{lang}.txt"))


def build_model(workdir: str, arch: str, flags: List[str], fixnorm: bool, seed: int = 1):
    """(model in eval mode, task), built as fairseq-train builds them."""
    argv = fairseq_arguments(workdir, "--task", "translation", "--source-lang", "src",
                             "--target-lang", "tgt", "--arch", arch, "--cpu", *flags,
                             "--share-decoder-input-output-embed", *(["--fixnorm"] if fixnorm else []))
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    utils.import_user_module(args)
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    return task.build_model(args).eval(), task


def without_cache(model) -> None:
    """Make every FixNorm embedding of ``model`` re-normalise on every call."""
    for module in model.modules():
        if isinstance(module, FixNormEmbedding):
            module.normalized_weight = module.normalize


def source_batch(dictionary: Dictionary, batch: int, length: int, seed: int = 0) -> Dict:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(dictionary.nspecial, len(dictionary), (batch, length), generator=g)
    src[:, -1] = dictionary.eos()
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), length)}}


def decode_seconds(generator: SequenceGenerator, sample: Dict, steps: int) -> Tuple[float, float]:
    """Wall time and CPU time of this process for one beam search over ``sample``; checks
    every hypothesis has ``steps`` tokens and a finite score."""
    start, start_cpu = time.perf_counter(), time.process_time()
    hypos = generator.generate(generator.model.models, sample)
    seconds = (time.perf_counter() - start, time.process_time() - start_cpu)
    for sentence in hypos:
        best = sentence[0]
        assert len(best["tokens"]) == steps, (len(best["tokens"]), steps)
        assert torch.isfinite(best["score"]), best["score"]
    return seconds


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000, help="dictionary size (types)")
    parser.add_argument("--arch", default="transformer_normplug_cpu")
    parser.add_argument("--flags", default="--prenorm,--scalenorm",
                        help="comma-separated model flags shared by every variant")
    parser.add_argument("--batch", type=int, default=8, help="source sentences per batch")
    parser.add_argument("--src-len", type=int, default=20, help="source tokens per sentence")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24, help="tokens generated per sentence")
    parser.add_argument("--reps", type=int, default=5, help="alternating repetitions")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", default=os.path.join(DEFAULT_RESULTS, "bench_decode.md"))
    args = parser.parse_args(argv)
    if args.vocab < 8 or args.reps < 1 or args.steps < 1:
        parser.error("need --vocab >= 8, --reps >= 1 and --steps >= 1")
    torch.set_num_threads(args.threads)
    flags = [f for f in args.flags.split(",") if f]
    with tempfile.TemporaryDirectory() as workdir:
        write_dictionary(workdir, args.vocab)
        generators = {}
        for variant in VARIANTS:
            model, task = build_model(workdir, args.arch, flags, variant != "no-fixnorm")
            if variant == "fixnorm-uncached":
                without_cache(model)
            generators[variant] = SequenceGenerator(
                [model], task.target_dictionary, beam_size=args.beam, max_len_a=0,
                max_len_b=args.steps - 1, min_len=args.steps - 1)
        sample = source_batch(task.source_dictionary, args.batch, args.src_len)
    load_before = load_average()
    others = OtherProcesses()
    seconds: Dict[str, List[Tuple[float, float]]] = {v: [] for v in VARIANTS}
    with torch.inference_mode():
        for rep in range(args.reps + 1):  # round 0 warms up
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
            for variant in order:
                t = decode_seconds(generators[variant], sample, args.steps)
                if rep:
                    seconds[variant].append(t)
    warning = load_warning(others.share())
    tokens = args.batch * args.steps
    rows, data = [], {"args": vars(args), "machine": machine_line(), "variants": {}}
    for variant in VARIANTS:
        tps = [tokens / wall for wall, _ in seconds[variant]]
        ratio, cpu_ratio = ([b[i] / t[i] for t, b in zip(seconds[variant], seconds["no-fixnorm"])]
                            for i in (0, 1))
        data["variants"][variant] = {"tokens_per_s": tps, "ratio": median(ratio),
                                     "cpu_ratio": median(cpu_ratio), "seconds": seconds[variant]}
        rows.append([variant, f"{median(tps):.1f}", " ".join(f"{x:.1f}" for x in tps),
                     f"{median(ratio):.3f}", f"{median(cpu_ratio):.3f}"])
    text = "\n".join([
        "# Decoding throughput: FixNorm vs no FixNorm",
        "",
        f"{machine_line()}; --arch {args.arch} {' '.join(flags)}, vocabulary {args.vocab}, "
        f"{args.batch} sentences x {args.src_len} source tokens, beam {args.beam}, "
        f"{args.steps} generated tokens each; {args.reps} alternating repetitions after one "
        f"warm-up; load average {load_before:.2f} at start.",
        "",
        markdown_table(["variant", "tok/s (median)", "tok/s per rep", "vs no-fixnorm",
                        "vs no-fixnorm (CPU time)"], rows),
        "",
        "`vs no-fixnorm`: median over repetitions of no-fixnorm's wall time / this variant's, "
        "same repetition (above 1 = faster); `(CPU time)`: the same with this process's CPU "
        "time, which time slices taken by other processes do not inflate.",
        *([f"\n{warning}"] if warning else []),
        "",
    ])
    publish(args.out, text, data)
    return text


if __name__ == "__main__":
    main()
