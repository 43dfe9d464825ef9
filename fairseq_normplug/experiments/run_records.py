"""The run's record files, status.json and scores.json (and a data folder's manifest.json):
written whole through atomic_files, read back only when every field the tables read has its
type."""
import json
import math
import os
from typing import Optional

from fairseq_normplug.atomic_files import write_text_atomic


#: the states of a run's status.json ("pending": none yet)
RUN_STATES = ("pending", "running", "done", "diverged", "failed")


def write_json_atomic(path: str, data: dict) -> None:
    """Write ``data`` to ``path`` as JSON through atomic_files (a full disk or a kill leaves the
    old file and no temporary one)."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def read_json(path: str) -> Optional[dict]:
    """The JSON object in a file the runner wrote (status.json, scores.json, manifest.json);
    None when it is missing, cut, not UTF-8 JSON or not an object (a corrupt file is as good
    as none: the runner writes it again)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, ValueError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return data if isinstance(data, dict) else None


def read_scores(path: str) -> Optional[dict]:
    """A scores.json with a finite test BLEU and every field the table reads of its type
    (:func:`record_problem`), else None (missing, corrupt, ``{}``, cut short, ``"sacrebleu":
    "x"``): a run without one is not scored and is decoded again."""
    scores = read_json(path)
    return scores if scores is not None and record_problem(path, scores) is None else None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return _number(value) and math.isfinite(value) and float(value).is_integer()


def _text(value) -> bool:
    return isinstance(value, str)


#: the fields of a run's records that results.csv, the figures and the runner read, and their
#: types (None, JSON's null, is allowed for each); other fields are not read
RECORD_FIELDS = {
    "status.json": {"minutes": (_number, "a number"), "updates": (_integer, "an integer"),
                    "exit_code": (_integer, "an integer"), "stopped_by": (_text, "text"),
                    "diverged": (_text, "text"), "error": (_text, "text"), "run_error": (_text, "text"),
                    "command": (lambda v: isinstance(v, list) and all(map(_text, v)), "a list of strings")},
    "scores.json": {**{name: (_number, "a number") for name in (
                        "tokenized_bleu", "sacrebleu", "chrf", "chrf++", "compound_split_bleu", "multi_bleu_detok",
                        "dev_bleu", "length_ratio", "sys_len", "ref_len")},
                    "selected_update": (_integer, "an integer"),
                    "sacrebleu_signature": (_text, "text"), "chrf_signature": (_text, "text")},
}


def record_problem(path: str, record: Optional[dict] = None) -> Optional[str]:
    """What is wrong with the run record ``path`` (a status.json or scores.json), in one line
    naming the file, or None when it is missing or good; ``record``: its content, already read.
    A bad record is never tabulated: the run reads as not started (status.json: a re-run resumes
    it from its checkpoints) or not scored (scores.json: decoded again)."""
    if record is None:
        if not os.path.exists(path):
            return None
        record = read_json(path)
        if record is None:
            return f"{path} is not a JSON object (cut short or corrupt)"
    kind = os.path.basename(path)
    if kind == "status.json" and record.get("status") not in RUN_STATES:
        return f"{path}: status {record.get('status')!r} is not one of {', '.join(RUN_STATES)}"
    if kind == "scores.json" and record.get("tokenized_bleu") is None:
        return f"{path} has no test BLEU (tokenized_bleu)"
    if kind == "scores.json" and _number(record["tokenized_bleu"]) and not math.isfinite(record["tokenized_bleu"]):
        return f"{path}: tokenized_bleu={record['tokenized_bleu']!r} is not a finite number"
    for name, (check, what) in RECORD_FIELDS.get(kind, {}).items():
        value = record.get(name)
        if value is not None and not check(value):
            return f"{path}: {name}={value!r} is not {what}"
    return None
