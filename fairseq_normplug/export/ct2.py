"""``fairseq-normplug-ct2``: export a trained ``transformer_normplug`` (or stock
``transformer``) checkpoint to CTranslate2, exactly or not at all (docs/deployment.md).

    fairseq-normplug-ct2 --model_path CHECKPOINT --data_dir DATA --output_dir OUT

The arguments are those of CTranslate2's ``ct2-fairseq-converter``, on which it is built
(``--user_dir``, ``--vocab_mapping`` and ``--force`` too; ``--quantization`` is refused: the
precision is chosen when the model is loaded). A
model CTranslate2 can express (PostNorm or PreNorm; LayerNorm, RMSNorm, ScaleNorm folded into
RMSNorm; FixNorm's normalised embeddings; the output bias and target vocabulary mask) is
written exactly; anything else is refused in one line naming it, before anything is written.
Every export is then checked: the greedy translations of the first ``--check_sentences``
sentences of ``--check_subset`` by the exported model and by the checkpoint (fairseq's own
search, in this process) must be identical, or nothing is written. The model is written into
a temporary folder beside OUT and renamed into place only once the check has passed.

ctranslate2 is an optional requirement: ``pip install fairseq-normplug[export]``.
"""
import argparse
import os
import sys
from typing import Optional, Sequence

from fairseq_normplug.atomic_files import atomic_output_dir
from fairseq_normplug.errors import NormplugError, exit_with_one_line

#: the sentences checked by default (the first of the valid split)
CHECK_SENTENCES = 20
INSTALL_HINT = "pip install 'fairseq-normplug[export]' (or pip install 'ctranslate2>=4.5')"


def parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="fairseq-normplug-ct2", description=doc[0],
                                epilog="\n\n".join(doc[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", required=True, help="the fairseq checkpoint (.pt)")
    p.add_argument("--data_dir", required=True,
                   help="the data folder it was trained on (fairseq-preprocess output, or a prepared folder with bin/)")
    p.add_argument("--output_dir", required=True, help="the CTranslate2 model folder to write")
    p.add_argument("--force", action="store_true", help="replace OUTPUT_DIR if it exists (once the check passed)")
    p.add_argument("--user_dir", help="a fairseq --user-dir to import besides this plugin (your own models or tasks)")
    p.add_argument("--vocab_mapping", help="a vocabulary mapping file to include, as ct2-fairseq-converter does")
    p.add_argument("--quantization", help="refused: the export is float32, the form the check compares; choose "
                                          "the precision when loading, ctranslate2.Translator(OUT, compute_type='int8')")
    p.add_argument("--check_subset", default="valid", help="the split whose first sentences check the export")
    p.add_argument("--check_sentences", type=int, default=CHECK_SENTENCES, metavar="N",
                   help=f"how many sentences to check (default {CHECK_SENTENCES}; at least 1)")
    return p


def check_arguments(args) -> None:
    """One-line refusals of bad arguments, before anything is loaded."""
    if not os.path.isfile(args.model_path):
        raise NormplugError(f"no such checkpoint: {args.model_path}")
    if os.path.lexists(args.output_dir) and not args.force:
        raise NormplugError(f"--output_dir {args.output_dir} already exists; pass --force to replace it")
    if args.quantization:
        raise NormplugError(f"--quantization {args.quantization}: the export is float32, the form that is checked "
                            f"against the checkpoint; choose the precision when loading it: "
                            f"ctranslate2.Translator('{args.output_dir}', compute_type='{args.quantization}')")
    for flag, path in (("--user_dir", args.user_dir), ("--vocab_mapping", args.vocab_mapping)):
        if path and not os.path.exists(path):
            raise NormplugError(f"{flag} {path}: no such file or folder")
    if args.check_sentences < 1:
        raise NormplugError(f"--check_sentences {args.check_sentences}: the export is always checked, "
                            f"give at least 1 sentence")
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        raise NormplugError(f"the CTranslate2 export needs the ctranslate2 package: {INSTALL_HINT}") from None


def export(args) -> str:
    """Convert, check and move into place; returns the line that reports it."""
    check_arguments(args)
    from fairseq_normplug.export.ct2_convert import convert_and_check, refuse_difference

    if args.user_dir:
        from fairseq.utils import import_user_module

        import_user_module(argparse.Namespace(user_dir=args.user_dir))
    with atomic_output_dir(args.output_dir, replace=args.force) as work_dir:
        result = convert_and_check(args.model_path, args.data_dir, work_dir, args.check_subset, args.check_sentences,
                                   vocab_mapping=args.vocab_mapping)
        refuse_difference(result, args.output_dir)
    return (f"exported {args.model_path} to {args.output_dir}: greedy translations of {len(result.reference)} "
            f"{result.split} sentences identical to the checkpoint's ({result.identical}/{len(result.reference)})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script; a refusal or a failed check is one line on stderr, exit status 2."""
    args = parser().parse_args(argv)
    try:
        print(export(args))
    except NormplugError as error:
        exit_with_one_line(error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
