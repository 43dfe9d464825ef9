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

Training and scoring a run (docs/experiments.md gives the guarantees: one decoder for dev and
test BLEU, checkpoint selection by dev BLEU, tokens per update on any device count, the
divergence rule, resuming after a kill, one owner down to the trainer; docs/fidelity.md, the
recipe details). Each job has its module, whose names this module re-exports:

* ``run_records``: status.json and scores.json, written atomically, read back only when valid;
* ``run_commands``: the fairseq-train and fairseq-generate commands, ``--train-flags``;
* ``batching``: ``--max-tokens`` x devices x ``--update-freq`` reaching ``tokens_per_update``;
* ``runs``: :class:`Run`, one row on one pair and seed, in its folder;
* ``processes``: the fairseq processes, stop signals forwarded to them;
* ``training``: the training plan, fairseq-train, the divergence rule, why training stopped;
* ``scoring``: the test set translated and scored.
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
