"""Train and evaluate one row of an experiment table on one prepared data folder.

A run lives in its own folder (``runs/<table>/<pair>/<row-slug>/``)::

    train.log            fairseq-train's log (JSON records), appended across resumes
    checkpoints/         checkpoint_last.pt, checkpoint_best.pt (the validation with the best dev BLEU),
                         the dictionaries and subword model beside them (fairseq_normplug/hub.py)
    generate-test.txt    fairseq-generate output on the test set
    scores.json          test BLEU (tokenized, sacreBLEU with signature, compound-split for en-de),
                         chrF and chrF++ with signature (the lines sacreBLEU scores),
                         the selected checkpoint's update and dev BLEU
    status.json          running | done | diverged | failed, with updates and minutes
    owner.lock           while a launcher owns the run (experiments/ownership.py)

What the runner adds to every recipe (docs/fidelity.md):

* **One decoder for dev and test.** The recipe's ``decoding`` spec (beam, GNMT alpha or
  lenpen, the authors' search, max_len_a/b of the per-sentence length cap) becomes both
  fairseq-train's dev-BLEU generator (``--eval-bleu-args``, ``--gnmt-alpha``,
  ``--gnmt-search``) and fairseq-generate's flags; dev BLEU is tokenized BLEU
  (``--eval-tokenized-bleu``), like the test score. Each sentence's length cap is its own
  (the task's default), so dev BLEU during training (validation batches) and the test decoder
  (other batches) give one checkpoint the same hypotheses.
* **Checkpoint selection by dev BLEU.** fairseq updates ``checkpoint_best.pt`` only when it
  saves, so ``--save-interval-updates`` is set to the effective ``--validate-interval-updates``
  (its last occurrence, the user's ``--train-flags`` included) and ``--keep-interval-updates 1``
  bounds the disk (the numbered interval file is deleted once training is done).
* **Post-processing from the manifest.** ``--eval-bleu-remove-bpe`` and ``--remove-bpe`` are
  the data folder's ``subword_method`` (manifest.json).
* **Tokens per update.** A recipe's ``tokens_per_update`` is reached exactly on any number of
  devices: the runner splits it evenly over the run's devices and sets ``--max-tokens`` per
  device (at most the recipe's ``--max-tokens``) and ``--update-freq`` (:func:`plan_batching`);
  a device count that cannot reach it is refused with one line before anything is trained.
* **Devices and threads.** A run's ``devices`` (``CUDA_VISIBLE_DEVICES``), ``num_devices`` and
  ``threads`` (``OMP_NUM_THREADS``) are set by its launcher (experiments/launchers.py); unset,
  a run uses what its process sees, as fairseq-train does.

Everything is resumable: a finished run is skipped, an interrupted one continues from
``checkpoint_last.pt``, and a run that diverged is recorded as ``diverged`` (a result, as in the
paper's Tables 2 and 5), not raised as an error: its loss or gradients became NaN/Inf, a dev loss
was worse than a uniform guess over the target vocabulary (:func:`diverged_at`; training is
stopped there), or no dev BLEU could be computed. Outputs
are written to temporary names and renamed, so nothing half-written is ever trusted. A job
killed at any moment (SIGKILL, a node lost) continues when the same command runs again:
checkpoints it left half-copied are deleted and its interrupted save is finished first
(:mod:`fairseq_normplug.checkpoint_safety`), a run whose training had ended is not trained
an update further, and the resumed run trains on the uninterrupted run's batches
(``--task translation_normplug``), so the table is the one an uninterrupted job writes.

**One owner down to the trainer.** fairseq-train and fairseq-generate are started by
:func:`run_process`: the run's lock records each one's pid while it runs
(:func:`fairseq_normplug.experiments.ownership.record_process`), and while a launcher executes
runs (:func:`stop_signals_forwarded`) SIGTERM, SIGINT and SIGHUP are forwarded to them; the
launcher waits for them to end (SIGKILL after :data:`STOP_GRACE_S` seconds), releases its runs,
and stops with :class:`LauncherStopped`. A stopped run is resumed by the next launcher, never
trained beside a process of the stopped one.

This module keeps the runner's names importable in one place; each concept lives in its own
module: the run's records (``run_records``), its fairseq processes (``processes``), the
batching (``batching``), its commands (``run_commands``), the run itself (``runs``), training
(``training``) and scoring (``scoring``).
"""
import subprocess  # noqa: F401 (tests replace runner.subprocess.Popen)

from fairseq_normplug import checkpoint_safety  # noqa: F401
from fairseq_normplug.experiments.configs import Recipe, Row, Schedule, Table, slug  # noqa: F401
from fairseq_normplug.experiments.training_log import (  # noqa: F401
    STOP_LINES, dev_loss, last_num_updates, logged_stop_reason, valid_losses, valid_record,
)
from fairseq_normplug.flag_lists import command_flags, last_flag_value, split_flags  # noqa: F401
from fairseq_normplug.experiments.run_records import (  # noqa: F401
    _integer, _number, read_json, read_scores, RECORD_FIELDS, record_problem, RUN_STATES, _text,
    write_json_atomic,
)
from fairseq_normplug.experiments.processes import (  # noqa: F401
    end_process, LauncherStopped, _on_stop_signal, _Processes, _PROCESSES, run_process, STOP_GRACE_S,
    stop_requested, STOP_SIGNALS, stop_signals_forwarded,
)
from fairseq_normplug.experiments.batching import (  # noqa: F401
    Batching, batching_flags, command_batching, plan_batching, world_size,
)
from fairseq_normplug.experiments.run_commands import (  # noqa: F401
    ALL_BATCHES, BIN_DIR, changed_flags, checkpoint_selection_flags, decoding_task_flags, dev_bleu_flags,
    generate_command, GENERATION_OPTIONS, generation_options, ignored_lr_problem, _is_data_folder,
    _is_number, LAMBDA_PEAK_SCHEDULERS, RUNNER_OWNED_FLAGS, runner_owned_problem, scaled_schedule_flags,
    subword_method, TASK, test_decoding_flags, train_command, train_flags, USER_DIR,
)
from fairseq_normplug.experiments.runs import (  # noqa: F401
    check_data_dir, Run, run_folder,
)
from fairseq_normplug.experiments.training import (  # noqa: F401
    diverged_at, DIVERGENCE_FACTOR, DIVERGENCE_MARKERS, _end_last_line, plan_summary, progress_line,
    stopped_by, target_vocabulary_size, train, _training_done, training_plan, TrainingPlan,
    uniform_guess_bits,
)
from fairseq_normplug.experiments.scoring import (  # noqa: F401
    evaluate, score_generation, selected_checkpoint, test_hypotheses, test_references,
)
