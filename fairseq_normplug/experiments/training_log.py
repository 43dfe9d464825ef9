"""Parse fairseq training logs written with ``--log-format json``.

Records are the lines ``<date> <time> | INFO | <kind> | {json}``, ``kind`` being
``train_inner`` (every ``--log-interval`` updates), ``train`` (epoch averages, keys prefixed
``train_``) or ``valid`` (keys prefixed ``valid_``; other validation subsets use their own
name as kind and prefix). Values are converted to floats (fairseq writes them as strings).

Robust to what real logs contain: other log lines and garbage are skipped, so is a truncated
last line; when a resumed run appends to the same log, the latest record of each update
number wins. The criterion settings of the run's configuration dump (the
``fairseq_cli.train | {...}`` line) give :attr:`TrainingLog.label_smoothing`.

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
from typing import Dict, List, Optional, Tuple, Union

from fairseq_normplug.errors import NormplugError

Record = Dict[str, Union[float, str]]
RECORD_LINE = re.compile(r"^[^|]*\|\s*[A-Z]+\s*\|\s*(?P<kind>[\w.-]+)\s*\|\s*(?P<payload>\{.*)$")
CONFIG_LINE = re.compile(r"\|\s*fairseq_cli\.train\s*\|\s*\{'_name'")
CRITERION = re.compile(r"'criterion': \{'_name': '(?P<name>[^']*)'(?P<body>[^}]*)\}")
LABEL_SMOOTHING = re.compile(r"'label_smoothing': (?P<value>[-+0-9.eE]+)")


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
    ``criterion``/``label_smoothing`` come from the last configuration dump (None if the log
    has none; label smoothing is 0.0 for criteria without it). ``skipped_lines`` counts the
    record-like lines that could not be parsed (garbage, truncated, no update number)."""
    path: str
    records: Dict[str, List[Record]] = field(default_factory=dict)
    criterion: Optional[str] = None
    label_smoothing: Optional[float] = None
    skipped_lines: int = 0

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


def parse_training_log(path: str) -> TrainingLog:
    """Parse one log file (see the module docstring)."""
    if not os.path.isfile(path):
        raise NormplugError(f"no such training log: {path}")
    log = TrainingLog(path=path)
    by_update: Dict[str, Dict[float, Record]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if CONFIG_LINE.search(line):
                criterion = _parse_criterion(line)
                if criterion:
                    log.criterion, log.label_smoothing = criterion
                continue
            match = RECORD_LINE.match(line)
            if not match:
                continue
            kind = match.group("kind")
            try:
                payload = json.loads(match.group("payload"))
            except json.JSONDecodeError:
                log.skipped_lines += 1
                continue
            record = {key: _to_number(value) for key, value in payload.items()} \
                if isinstance(payload, dict) else {}
            update = record.get(update_key(kind))
            if not isinstance(update, float) or math.isnan(update):
                log.skipped_lines += 1
                continue
            by_update.setdefault(kind, {})[update] = record  # a resumed run's record wins
    log.records = {kind: [records[u] for u in sorted(records)] for kind, records in by_update.items()}
    return log
