"""The fairseq-train and fairseq-generate commands of a run: the recipe's, schedule's and row's
flags, one decoder for dev and test BLEU, checkpoint selection by dev BLEU, the batching, and the
refusals of ``--train-flags`` the runner cannot honour."""
import glob
import json
import os
from typing import TYPE_CHECKING, List, Optional, Sequence

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import portable_paths
from fairseq_normplug.experiments.batching import batching_flags, world_size
from fairseq_normplug.experiments.configs import Recipe, Schedule
from fairseq_normplug.experiments.run_records import read_json
from fairseq_normplug.fairseq_commands import BIN_DIR, fairseq_command, USER_DIR  # noqa: F401
from fairseq_normplug.flag_lists import command_flags, last_flag_value, split_flags
from fairseq_normplug.prepare.bpe import METHODS as SUBWORD_METHODS

if TYPE_CHECKING:
    from fairseq_normplug.experiments.runs import Run


#: fairseq's main branch drops the last batch unless it is a multiple of this (README)
ALL_BATCHES = ["--required-batch-size-multiple", "1"]
TASK = ["--task", "translation_normplug"]
#: fairseq generation options a recipe's ``decoding`` spec may set (GNMT's alpha is a task option)
GENERATION_OPTIONS = ("beam", "lenpen", "max_len_a", "max_len_b")


def scaled_schedule_flags(schedule: Schedule, recipe: Recipe) -> List[str]:
    """The schedule's flags with ``--warmup-updates``, ``--lr-lambda`` and ``--lr`` scaled by the
    recipe's ``warmup_scale``, ``lr_lambda_scale`` and ``lr_scale`` (short CPU runs of small
    models: a shorter warmup, a lambda that keeps eq. 7's peak lr where the recipe wants it, and
    NoWarmup's constant lr scaled like that peak)."""
    flags = list(schedule.flags)
    for flag, scale, convert in (("--warmup-updates", recipe.warmup_scale, lambda v: str(round(v))),
                                 ("--lr-lambda", recipe.lr_lambda_scale, lambda v: f"{v:.4g}"),
                                 ("--lr", recipe.lr_scale, lambda v: f"{v:.4g}")):
        if flag in flags and scale != 1.0:
            i = flags.index(flag) + 1
            value = float(flags[i]) * scale
            flags[i] = convert(max(value, 1) if flag == "--warmup-updates" and value > 0 else value)
    return flags


#: fairseq-train flags every run's command sets itself (:meth:`Run.train_command`), and why
#: ``--train-flags`` cannot change them
RUNNER_OWNED_FLAGS = {
    "--save-dir": "each run keeps its checkpoints in its own folder, RUN_DIR/checkpoints, where it "
                  "resumes, selects and evaluates them (--runs-dir or train.sh --run-dir moves the run folders)",
    "--seed": "each run trains with its own seed, the one its folder is named after "
              "(reproduce.sh --seeds N [N ...])",
}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_data_folder(text: str) -> bool:
    """Whether ``text`` names a folder of fairseq data: its dictionaries, or a ``bin/`` holding them."""
    if not os.path.isdir(text):
        return False
    return any(glob.glob(os.path.join(text, *sub, "dict.*.txt")) for sub in ((), ("bin",)))


def runner_owned_problem(flags: Sequence[str]) -> Optional[str]:
    """Why ``flags`` (``--train-flags``) would change what the runner sets in every run's
    command, or None: :data:`RUNNER_OWNED_FLAGS`, or a data path (fairseq-train's positional
    argument: the first item, an item after another non-flag that is not a number, or a
    folder of fairseq data)."""
    for i, item in enumerate(flags):
        name = item.split("=", 1)[0]
        if name in RUNNER_OWNED_FLAGS:
            return f"{name} is set by the runner: {RUNNER_OWNED_FLAGS[name]}; drop it from --train-flags"
        if item.startswith("-"):
            continue
        after_value = i > 0 and not flags[i - 1].startswith("-") and not _is_number(item)
        if i == 0 or after_value or _is_data_folder(item):
            return (f"{item!r} is a data path, which the runner gives every run (its pair's prepared data "
                    f"folder: reproduce.sh --data PAIR=DIR, train.sh DATA_DIR); drop it from --train-flags")
    return None


def train_flags(text: str) -> List[str]:
    """``--train-flags``, split as a shell splits it (quotes keep ``'(0.9, 0.999)'`` one value);
    a flag the runner sets in every run (:func:`runner_owned_problem`) is refused in one line."""
    try:
        flags = split_flags(text)
    except ValueError as error:
        raise NormplugError(f"--train-flags {text!r}: {error} (it is split like a shell command line)") from None
    problem = runner_owned_problem(flags)
    if problem:
        raise NormplugError(f"--train-flags {text!r}: {problem}")
    return flags


def decoding_task_flags(decoding: dict) -> List[str]:
    """Task flags of a decoding spec (``--gnmt-alpha``, ``--gnmt-search``, ``--batch-length-cap``),
    shared by fairseq-train (dev BLEU) and fairseq-generate (test)."""
    flags = ["--gnmt-alpha", f"{decoding['gnmt_alpha']:g}"] if decoding.get("gnmt_alpha") is not None else []
    return flags + [f"--{key.replace('_', '-')}" for key in ("gnmt_search", "batch_length_cap") if decoding.get(key)]


def generation_options(decoding: dict) -> dict:
    """The fairseq generation options of a decoding spec, as ``--eval-bleu-args`` takes them."""
    return {key: decoding[key] for key in GENERATION_OPTIONS if key in decoding}


def dev_bleu_flags(decoding: dict, subword_method: str) -> List[str]:
    """fairseq-train flags: tokenized dev BLEU with the test set's decoder; select by it."""
    return ["--eval-bleu", "--eval-tokenized-bleu", "--eval-bleu-args", json.dumps(generation_options(decoding)),
            "--eval-bleu-remove-bpe", subword_method, *decoding_task_flags(decoding),
            "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric"]


def test_decoding_flags(decoding: dict, subword_method: str) -> List[str]:
    """fairseq-generate flags of the same decoding spec (and post-processing) as dev BLEU."""
    flags = []
    for key, value in generation_options(decoding).items():
        flags += [f"--{key.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return flags + decoding_task_flags(decoding) + ["--remove-bpe", subword_method]


#: lr schedulers whose peak lr is eq. 7's (set by --lr-lambda), so that --lr changes nothing:
#: always (inv_sqrt_decay), or with a warmup unless --warmup-peak lr (val_decay)
LAMBDA_PEAK_SCHEDULERS = ("inv_sqrt_decay", "val_decay")


def ignored_lr_problem(command: List[str], user_flags: List[str]) -> Optional[str]:
    """Why a ``--lr`` of ``user_flags`` (a row's and ``--train-flags``) does nothing in
    ``command``, or None: under inv_sqrt_decay, or val_decay with a warmup to eq. 7's peak,
    the lr comes from ``--lr-lambda`` and fairseq would silently drop the user's ``--lr``."""
    lr = last_flag_value(user_flags, "--lr")
    scheduler = last_flag_value(command, "--lr-scheduler")
    if lr is None or scheduler not in LAMBDA_PEAK_SCHEDULERS:
        return None
    if scheduler == "val_decay" and (int(float(last_flag_value(command, "--warmup-updates") or 0)) == 0
                                     or last_flag_value(command, "--warmup-peak") == "lr"):
        return None
    return (f"--lr {lr} is ignored by --lr-scheduler {scheduler} (its peak lr is eq. 7's, set by --lr-lambda); "
            f"give --lr-lambda instead" + (", or --warmup-peak lr" if scheduler == "val_decay" else ""))


def checkpoint_selection_flags(flags: List[str]) -> List[str]:
    """Save at every validation, so that checkpoint_best.pt is the best dev-BLEU validation
    (fairseq updates it only when it saves); keep one numbered interval checkpoint."""
    interval = last_flag_value(flags, "--validate-interval-updates") or "0"
    return ["--save-interval-updates", interval, "--keep-interval-updates", "1"]


def changed_flags(recorded: List[str], command: List[str]) -> List[str]:
    """How ``command`` differs from the ``recorded`` one a run was trained with, as
    ``--flag old -> new`` (``(none)`` for an absent flag). Both are compared in their portable
    form (experiments/portable_paths.py: ``$RUN``, ``$DATA``, ``$PLUGIN``...), so a run folder
    copied to another machine, or its repository moved, trains the same, and an old record with
    the absolute paths of the machine that ran it still matches."""
    def shown(value: Optional[str]) -> str:
        return "(none)" if value is None else (value or "(set)")

    old = command_flags(portable_paths.recorded_form(recorded))
    new = command_flags(portable_paths.recorded_form(command))
    changes = []
    for flag in dict.fromkeys([*old, *new]):
        before, after = old.get(flag), new.get(flag)
        if before == after:
            continue
        changes.append(f"{flag} {shown(before)} -> {shown(after)}")
    return changes


def subword_method(data_dir: str, assumed: Optional[str] = None) -> str:
    """The data folder's subword method (``subword_nmt`` or ``sentencepiece``): the manifest's
    ``subword_method`` field, or for manifests written before it existed their ``recipe.bpe``.
    It is also fairseq's post-processing name (--remove-bpe, --eval-bleu-remove-bpe).
    ``assumed`` is returned for a folder not prepared yet (``--print-commands`` before the data)."""
    manifest = read_json(os.path.join(data_dir, "manifest.json"))
    if manifest is None and assumed is not None:
        return assumed
    if manifest is None:
        raise NormplugError(f"{data_dir} has no readable manifest.json to tell its subword method; "
                            f"prepare it with scripts/prepare_*.sh (docs/data.md)")
    method = manifest.get("subword_method", (manifest.get("recipe") or {}).get("bpe"))
    if method not in SUBWORD_METHODS:
        raise NormplugError(f"{data_dir}/manifest.json: subword_method {method!r} is not one of "
                            f"{', '.join(SUBWORD_METHODS)}; prepare the data with scripts/prepare_*.sh")
    return method


def train_command(run: "Run", extra: List[str] = ()) -> List[str]:
    """``run``'s fairseq-train command: the recipe's, schedule's (scaled) and row's flags, dev BLEU
    with the test decoder, the batching that reaches the recipe's tokens per update, ``extra``
    (``--train-flags``) and checkpoint selection by dev BLEU."""
    recipe = run.recipe
    schedule = run.table.schedules[run.row.schedule]
    flags = [*recipe.train, *scaled_schedule_flags(schedule, recipe), *run.row.model, *run.row.train]
    command = fairseq_command(
        "fairseq-train", os.path.join(run.data_dir, "bin"), *TASK, "--source-lang", run.src, "--target-lang", run.tgt,
        "--arch", recipe.arch, *flags,
        *dev_bleu_flags(recipe.decoding, subword_method(run.data_dir, run.assumed_subword)),
        "--save-dir", run.path("checkpoints"), "--no-epoch-checkpoints", "--seed", str(run.seed),
        "--log-format", "json", "--num-workers", "0", *ALL_BATCHES, *run.device_flags(),
        *batching_flags(recipe, flags, world_size(flags + list(extra), run.num_devices)), *extra)
    problem = ignored_lr_problem(command, [*run.row.model, *run.row.train, *extra])
    if problem:
        raise NormplugError(f"{run.table.name} row {run.row.name!r}: {problem}")
    return command + checkpoint_selection_flags(command)


def generate_command(run: "Run", checkpoint: str, subset: str = "test") -> List[str]:
    """fairseq-generate on ``subset`` with the decoder and post-processing of dev BLEU."""
    return fairseq_command(
        "fairseq-generate", os.path.join(run.data_dir, "bin"), *TASK, "--source-lang", run.src,
        "--target-lang", run.tgt, "--path", checkpoint, "--gen-subset", subset,
        *test_decoding_flags(run.recipe.decoding, subword_method(run.data_dir, run.assumed_subword)),
        *run.recipe.generate, *ALL_BATCHES, *run.device_flags())
