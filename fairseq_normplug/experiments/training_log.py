"""Parse fairseq training logs, in every format fairseq writes them.

A log line is ``<date> <time> | <LEVEL> | <kind> | <message>`` (fairseq-train) or
``[<date> <time>][<kind>][<LEVEL>] - <message>`` (fairseq-hydra-train's ``hydra_train.log``
in its run folder: pass the folder or the file). Records are the messages of the kinds
``train_inner`` (every ``--log-interval`` updates), ``train`` (epoch averages) and ``valid``
(other validation subsets use their own name as kind), in either message format:

* ``--log-format json``: a JSON object; ``train``/``valid`` keys are prefixed ``train_``/``valid_``;
* ``--log-format simple``: ``epoch 001:  4 / 7 loss=6.4, ..., num_updates=4`` (train_inner),
  ``epoch 001 | loss 6.6 | ... | num_updates 6`` (train, valid); their keys are given the
  kind's prefix here, so that every format gives the same records;
* ``--log-format tqdm`` (fairseq's default on a terminal): the train and valid records as
  simple writes them; the train_inner records (the per-update statistics, the plugin's norm
  statistics among them) are shown in the progress bar only, never logged;
* ``--log-format none`` logs no records: such a log is refused, naming the format to use.

Values are converted to floats (fairseq writes them as strings). The configuration dump (the
``fairseq_cli.train`` line ``{'_name': ...}``) gives :attr:`TrainingLog.label_smoothing` and
:attr:`TrainingLog.log_format`.

Robust to what real logs contain: other log lines and garbage are skipped, so is a truncated
last line; when a resumed run appends to the same log, the latest record of each update
number wins.

Plugin keys (``--norm-stats-interval N``) in ``train_inner`` records: ``g:<norm>``
(ScaleNorm g), ``alpha:<norm>`` (DyT alpha), ``gain:<norm>`` (mean |gain| of
LayerNorm/RMSNorm/DyT), ``in_std:<norm>`` (std of the norm's input) and ``sat:<norm>``
(DyT: the fraction of inputs with ``|alpha x| > 2``), where ``<norm>`` is
``enc{i}.attn``, ``enc{i}.ffn``, ``dec{i}.attn`` (self-attention), ``dec{i}.cross``
(encoder-decoder attention), ``dec{i}.ffn``, ``enc.final`` or ``dec.final`` (PreNorm only).
"""
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from fairseq_normplug.errors import NormplugError

Record = Dict[str, Union[float, str]]
#: fairseq-train's log line, and hydra's (fairseq-hydra-train)
LOG_LINES = (re.compile(r"^[^|\[]*\|\s*[A-Z]+\s*\|\s*(?P<kind>[\w.-]+)\s*\| ?(?P<message>.*)$"),
             re.compile(r"^\[[^\]]*\]\[(?P<kind>[\w.-]+)\]\[[A-Z]+\] - (?P<message>.*)$"))
#: simple/tqdm: a train_inner record, and the first field of an epoch record
SIMPLE_INNER = re.compile(r"^epoch (?P<epoch>\d+):\s+\d+ / \d+ (?P<stats>.*)$")
SIMPLE_EPOCH = re.compile(r"^epoch (?P<epoch>\d+) \| ")
SIMPLE_FIELD = re.compile(r"^(?P<key>\S+) (?P<value>\S+)$")
CONFIG_KIND = "fairseq_cli.train"
CRITERION = re.compile(r"'criterion': \{'_name': '(?P<name>[^']*)'(?P<body>[^}]*)\}")
LABEL_SMOOTHING = re.compile(r"'label_smoothing': (?P<value>[-+0-9.eE]+)")
LOG_FORMAT = re.compile(r"'log_format': (?:'(?P<name>\w+)'|None)")
#: the log of fairseq-hydra-train's run folder (hydra names it after the job)
HYDRA_LOG = "hydra_train.log"
#: lines fairseq-train writes once training has run, whatever the log format
TRAINED_LINES = ("end of epoch", "done training")
#: the advice of every refusal
USE_FORMAT = "train with --log-format json (or simple)"


def _to_number(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def update_key(kind: str) -> str:
    """The key holding the update number in records of ``kind``."""
    return "num_updates" if kind == "train_inner" else f"{kind}_num_updates"


@dataclass
class TrainingLog:
    """Records of one training log: ``records[kind]`` is sorted by update number.
    ``criterion``/``label_smoothing``/``log_format`` come from the last configuration dump (None if the log
    has none; label smoothing is 0.0 for criteria without it). ``skipped_lines`` counts the
    record-like lines that could not be parsed (garbage, truncated, no update number)."""
    path: str
    records: Dict[str, List[Record]] = field(default_factory=dict)
    criterion: Optional[str] = None
    label_smoothing: Optional[float] = None
    skipped_lines: int = 0
    #: ``--log-format`` of the configuration dump (``tqdm``, fairseq's default, when it says
    #: None); None for a log without one
    log_format: Optional[str] = None

    def kind(self, kind: str) -> List[Record]:
        """The records of one kind (empty list if none)."""
        return self.records.get(kind, [])

    def keys(self, kind: str) -> List[str]:
        """Every key that occurs in records of ``kind``, in first-seen order."""
        return list(dict.fromkeys(key for record in self.kind(kind) for key in record))

    def series(self, kind: str, key: str) -> Tuple[List[float], List[float]]:
        """(update numbers, values) of ``key`` over the records of ``kind`` that hold it."""
        points = [(record[update_key(kind)], record[key]) for record in self.kind(kind)
                  if isinstance(record.get(key), float)]
        return [u for u, _ in points], [v for _, v in points]

    def latest(self, kind: str, prefix: str) -> Dict[str, float]:
        """{name: last logged value} of the keys ``<prefix><name>``, e.g. ``latest
        ("train_inner", "g:")`` gives the final ScaleNorm g of every norm."""
        values = {}
        for record in self.kind(kind):
            for key, value in record.items():
                if key.startswith(prefix) and isinstance(value, float):
                    values[key[len(prefix):]] = value
        return values

    @property
    def last_update(self) -> Optional[int]:
        """The highest update number of any training record (None if there is none)."""
        updates = [record[update_key(kind)] for kind in ("train_inner", "train")
                   for record in self.kind(kind)]
        return int(max(updates)) if updates else None


def _parse_criterion(line: str) -> Optional[Tuple[str, float]]:
    match = CRITERION.search(line)
    if not match:
        return None
    smoothing = LABEL_SMOOTHING.search(match.group("body"))
    return match.group("name"), float(smoothing.group("value")) if smoothing else 0.0


def parse_message(kind: str, message: str) -> Optional[Record]:
    """The record of one log message of ``kind`` in any format (the module docstring), None
    when the message is no record; raises ValueError for a record-like message that is broken
    (garbage, a truncated line)."""
    if message.startswith("{"):
        payload = json.loads(message)
        return {key: _to_number(value) for key, value in payload.items()} if isinstance(payload, dict) else {}
    inner = SIMPLE_INNER.match(message)
    if inner:
        fields = (field.partition("=") for field in inner.group("stats").split(", "))
        return {"epoch": float(inner.group("epoch")), **{key: _to_number(value) for key, _, value in fields}}
    epoch = SIMPLE_EPOCH.match(message)
    if epoch:
        record: Record = {"epoch": float(epoch.group("epoch"))}
        for part in message.split(" | ")[1:]:
            field = SIMPLE_FIELD.match(part)  # "valid on 'valid' subset" is no field
            if field:
                record[f"{kind}_{field.group('key')}"] = _to_number(field.group("value"))
        return record
    return None


def log_file(path: str) -> str:
    """``path``, or for a fairseq-hydra-train run folder the log in it."""
    if not os.path.isdir(path):
        return path
    inside = os.path.join(path, HYDRA_LOG)
    if not os.path.isfile(inside):
        raise NormplugError(f"{path} is a folder without {HYDRA_LOG}: pass a training log, or the run "
                            f"folder of fairseq-hydra-train")
    return inside


def parse_training_log(path: str) -> TrainingLog:
    """Parse one log file, or fairseq-hydra-train's run folder (see the module docstring).
    Raises :class:`NormplugError` for a log in which training ran but fairseq wrote no record
    (``--log-format none``), naming the format to train with."""
    if not os.path.exists(path):
        raise NormplugError(f"no such training log: {path}")
    log = TrainingLog(path=path)
    by_update: Dict[str, Dict[float, Record]] = {}
    trained = False
    with open(log_file(path), encoding="utf-8", errors="replace") as f:
        for line in f:
            match = next(filter(None, (pattern.match(line.rstrip("\r\n")) for pattern in LOG_LINES)), None)
            if not match:
                continue
            kind, message = match.group("kind"), match.group("message")
            if kind == CONFIG_KIND and message.startswith("{'_name'"):
                _read_config(log, message)
                continue
            trained = trained or (kind == CONFIG_KIND and message.startswith(TRAINED_LINES))
            try:
                record = parse_message(kind, message)
            except ValueError:
                log.skipped_lines += 1
                continue
            if record is None:
                continue
            update = record.get(update_key(kind))
            if not isinstance(update, float) or math.isnan(update):
                log.skipped_lines += 1
                continue
            by_update.setdefault(kind, {})[update] = record  # a resumed run's record wins
    log.records = {kind: [records[u] for u in sorted(records)] for kind, records in by_update.items()}
    if trained and not log.records:
        written = f"written with --log-format {log.log_format}" if log.log_format else "in a format it cannot read"
        raise NormplugError(f"{path}: training ran but the log holds no training records ({written}); "
                            f"{USE_FORMAT}")
    return log


def _read_config(log: TrainingLog, dump: str) -> None:
    criterion = _parse_criterion(dump)
    if criterion:
        log.criterion, log.label_smoothing = criterion
    log_format = LOG_FORMAT.search(dump)
    if log_format:
        log.log_format = log_format.group("name") or "tqdm"


def missing_records_cause(logs: Sequence[TrainingLog], kind: str) -> Optional[str]:
    """Why none of ``logs`` holds a record of ``kind`` when the log format is the cause (tqdm
    shows train_inner records in its progress bar only), else None."""
    if any(log.kind(kind) for log in logs):
        return None
    formats = sorted({log.log_format for log in logs if log.log_format in ("tqdm", "none")})
    if not formats:
        return None
    return (f"the logs hold no {kind} records: they were written with --log-format {' and '.join(formats)}, "
            f"which never logs them; {USE_FORMAT}")


# ---------------------------------------------------------------------------------------
# Lines of a ``--log-format json`` log as fairseq writes them (values are strings), read as
# they stream in: the runner's progress and divergence rule, the preflight's and the
# benchmarks' speed.

#: how fairseq-train says why it stopped: the plugin's schedulers' rules, fairseq's own --patience
STOP_LINES = (re.compile(r"stopping training after update \d+: (?P<reason>.+)$"),
              re.compile(r"(?P<reason>early stop since valid performance hasn't improved for last \d+ runs)"))
#: the update number of any JSON record (train_inner, train, valid)
JSON_UPDATE = re.compile(r'"(?:train_|valid_)?num_updates": "(\d+)"')


def json_record(line: str, kind: str) -> Optional[dict]:
    """The JSON record of one log line of ``kind`` (``train_inner``, ``train``, ``valid``) as
    fairseq wrote it, None for any other line or a broken one."""
    marker = f"| {kind} | "
    if marker not in line:
        return None
    try:
        record = json.loads(line.split(marker, 1)[1])
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def json_records(text: str, kind: str) -> List[dict]:
    """The JSON records of ``kind`` in the log ``text``, in order (:func:`json_record`)."""
    records = (json_record(line, kind) for line in text.splitlines())
    return [record for record in records if record is not None]


def valid_record(line: str) -> Optional[dict]:
    """The JSON record of a fairseq-train validation line, None for any other line."""
    return json_record(line, "valid")


def dev_loss(record: Optional[dict]) -> Optional[float]:
    """The dev loss of a validation record (NaN and inf included), None without one."""
    try:
        return float(record.get("valid_loss"))
    except (AttributeError, TypeError, ValueError):
        return None


def valid_losses(log_path: str) -> List[float]:
    """The dev losses a train.log recorded so far (an earlier attempt's, for a resumed run)."""
    if not os.path.exists(log_path):
        return []
    with open(log_path, encoding="utf-8", errors="replace") as f:
        losses = [dev_loss(valid_record(line)) for line in f]
    return [loss for loss in losses if loss is not None]


def logged_stop_reason(log_path: str) -> Optional[str]:
    """The last stopping rule the log at ``log_path`` names (:data:`STOP_LINES`: ``--stop-lr``,
    ``--stop-patience``, fairseq's ``--patience``); None without one or without a log."""
    reason = None
    if os.path.exists(log_path):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                for pattern in STOP_LINES:
                    match = pattern.search(line.rstrip())
                    if match:
                        reason = match.group("reason")
    return reason


def last_num_updates(log_path: str) -> Optional[int]:
    """The update number of the last JSON record in the log at ``log_path`` (None without one)."""
    found = None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            match = JSON_UPDATE.search(line)
            if match:
                found = int(match.group(1))
    return found
