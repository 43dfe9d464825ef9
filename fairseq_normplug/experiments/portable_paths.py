"""Portable run records: the paths of a command written relative to named folders, so that a
run folder (or a whole runs folder) copied to another machine or checkout still reads the same.

A recorded command (``status.json``'s ``command``), a results table's ``config`` column and a
conversion report name every path under one of these folders by its placeholder:

==============  ==========================================================================
``$RUN``        the run's folder (the one holding ``status.json``): ``--save-dir $RUN/checkpoints``
``$RUNS``       a runs folder (``RUNS/TABLE/PAIR/ROW``), where a path names a run by its place in it
``$DATA``       the run's prepared data folder: ``$DATA/bin``
``$PLUGIN``     this package's folder (``fairseq_normplug/``): ``--user-dir $PLUGIN``
``$CHECKOUT``   the project's folder (the checkout): ``$CHECKOUT/examples/...``
``$VENV``       the Python environment (``sys.prefix``)
``$HOME``       the user's home folder (a cache there, in a log)
==============  ==========================================================================

and the programs of the environment (``BIN/fairseq-train``) by their bare name
(``fairseq-train``). The most specific folder wins (``$RUN`` before ``$RUNS``, ``$PLUGIN``
before ``$CHECKOUT``); a path under none of them stays as it was given.

:func:`to_portable` writes that form, :func:`from_portable` reads it back on this machine, and
:func:`recorded_form` is the one form two commands are compared in (the resume/skip decision):
a record written before portable records (absolute paths of whatever machine ran it) is
turned portable with the folders its own command names (:func:`command_roots`).
"""
import os
import re
import sys
from typing import Dict, List, Optional, Sequence

from fairseq_normplug.fairseq_commands import BIN_DIR
from fairseq_normplug.flag_lists import last_flag_value
from fairseq_normplug.resources import PACKAGE_DIR, PROJECT_DIR

#: the placeholders, most specific first when two folders nest at the same depth
PLACEHOLDERS = ("RUN", "RUNS", "DATA", "PLUGIN", "CHECKOUT", "VENV", "HOME")
#: the programs' folder: a program there is recorded by its bare name
BIN = "BIN"


def default_roots() -> Dict[str, str]:
    """The folders of this process: the package, the checkout, the environment and its programs."""
    return {"PLUGIN": PACKAGE_DIR, "CHECKOUT": PROJECT_DIR, "VENV": sys.prefix, "HOME": os.path.expanduser("~"),
            BIN: BIN_DIR}


def run_roots(run_dir: str, data_dir: Optional[str] = None) -> Dict[str, str]:
    """:func:`default_roots` and a run's own folders (``$RUN``, ``$DATA``)."""
    roots = default_roots()
    roots["RUN"] = run_dir
    if data_dir:
        roots["DATA"] = data_dir
    return roots


def _ordered(roots: Dict[str, str]) -> List[tuple]:
    """(name, absolute folder) of the placeholder roots, the longest folder first (the most
    specific wins), then in :data:`PLACEHOLDERS` order."""
    items = [(name, os.path.abspath(folder).rstrip(os.sep) or os.sep) for name, folder in roots.items()
             if name != BIN and folder]
    return sorted(items, key=lambda item: (-len(item[1]), PLACEHOLDERS.index(item[0])
                                           if item[0] in PLACEHOLDERS else len(PLACEHOLDERS)))


def portable_text(text: str, roots: Dict[str, str]) -> str:
    """``text`` (one command item, a comma list, a log line) with every path under a root written
    as ``$NAME/rest`` (a folder itself as ``$NAME``); a program of ``roots[BIN]`` by its name."""
    if roots.get(BIN):
        bin_dir = re.escape(os.path.abspath(roots[BIN]).rstrip(os.sep) + os.sep)
        text = re.sub(rf"(?<![\w./$-]){bin_dir}(?=[\w.-]+(?![\w./-]))", "", text)
    for name, folder in _ordered(roots):
        if folder == os.sep:
            continue
        text = re.sub(rf"(?<![\w./$-]){re.escape(folder)}(?=$|/|[^\w.-])", lambda _: f"${name}", text)
    return text


def to_portable(command: Sequence[str], roots: Dict[str, str]) -> List[str]:
    """A command's items with their paths in portable form (module docstring)."""
    return [portable_text(item, roots) for item in command]


def expanded(items: Sequence[str], roots: Dict[str, str]) -> List[str]:
    """``items`` (flags, paths) with each placeholder replaced by where it is on this machine
    (``roots``)."""
    def expand(item: str) -> str:
        return re.sub(r"(?<![\w$])\$(" + "|".join(PLACEHOLDERS) + r")(?![\w])",
                      lambda match: roots.get(match.group(1), match.group(0)), item)
    return [expand(item) for item in items]


def from_portable(command: Sequence[str], roots: Dict[str, str]) -> List[str]:
    """The absolute command of a portable one on this machine (``roots``: where each placeholder
    is here); a bare program name as the first item is found in ``roots[BIN]``."""
    out = expanded(command, roots)
    if out and roots.get(BIN) and os.sep not in out[0]:
        out[0] = os.path.join(roots[BIN], out[0])
    return out


def command_roots(command: Sequence[str]) -> Dict[str, str]:
    """The folders a fairseq-train command of the runner names itself, wherever it ran: its
    program's folder, ``DATA/bin``, ``--user-dir`` (the package; its parent the checkout) and
    ``--save-dir RUN/checkpoints``. Only absolute ones (a portable command names none)."""
    roots: Dict[str, str] = {}
    if command and os.path.isabs(command[0]):
        roots[BIN] = os.path.dirname(command[0])
        roots["VENV"] = os.path.dirname(roots[BIN])
    if len(command) > 1 and os.path.isabs(command[1]) and os.path.basename(command[1]) == "bin":
        roots["DATA"] = os.path.dirname(command[1])
    user_dir = last_flag_value(command, "--user-dir")
    if user_dir and os.path.isabs(user_dir):
        roots["PLUGIN"] = user_dir
        roots["CHECKOUT"] = os.path.dirname(user_dir)
    save_dir = last_flag_value(command, "--save-dir")
    if save_dir and os.path.isabs(save_dir) and os.path.basename(save_dir) == "checkpoints":
        roots["RUN"] = os.path.dirname(save_dir)
    return roots


def recorded_form(command: Sequence[str], roots: Optional[Dict[str, str]] = None) -> List[str]:
    """The portable form two training commands are compared in: ``roots`` (default: the
    folders the command names itself, :func:`command_roots`), then this process's own folders
    for what is left (an old record of this machine)."""
    first = to_portable(command, roots if roots is not None else command_roots(command))
    return to_portable(first, default_roots())


def run_folder_of(path: str) -> Optional[str]:
    """The run folder (the one with ``status.json``) ``path`` lies in, e.g. its checkpoint's."""
    folder = os.path.dirname(os.path.abspath(path))
    while folder != os.path.dirname(folder):
        if os.path.isfile(os.path.join(folder, "status.json")):
            return folder
        folder = os.path.dirname(folder)
    return None


def shown_path(path: str) -> str:
    """A path as a report shows it: under a run of a runs folder as ``$RUNS/TABLE/PAIR/ROW/...``,
    else under :func:`default_roots` (``$CHECKOUT/data/...``), else as it is."""
    roots = default_roots()
    run = run_folder_of(path)
    if run:
        roots["RUNS"] = os.path.dirname(os.path.dirname(os.path.dirname(run)))
    return portable_text(os.path.abspath(path), roots)


#: a machine folder's start (``/work/``, ``/tmp/``...) not inside a longer name (``a/tmp/``, ``$/tmp/``):
#: matched from its leading ``/``, which the regex engine finds by a fast scan, and the look-behind
#: only tried there (a look-behind first is tried at every character: 65 times slower on docs/)
ABSOLUTE_PATH = re.compile(r"/(?<![\w.$-]/)(?:work|root|home|tmp|Users|private/var)/")


def absolute_paths(text: str, extra: Sequence[str] = ()) -> List[str]:
    """The machine paths in ``text`` (``/work/``, ``/home/``, ``/tmp/``... and ``extra``
    folders such as this checkout): what a portable record must not hold."""
    found = [match.group(0) for match in ABSOLUTE_PATH.finditer(text)]
    found += [folder for folder in extra if folder and folder in text]
    return found


def migrate_runs(runs_dir: str, echo=print) -> int:
    """Rewrite the ``status.json`` of every run folder under ``runs_dir`` (and its ``train.log``
    paths) in portable form; no run is retrained. Returns the number of files rewritten."""
    import json

    from fairseq_normplug.atomic_files import write_text_atomic

    changed = 0
    for folder, _, files in os.walk(runs_dir):
        if "status.json" not in files:
            continue
        with open(os.path.join(folder, "status.json"), encoding="utf-8") as f:
            status = json.load(f)
        roots = command_roots(status.get("command") or [])
        roots.setdefault("RUN", folder)
        runs = os.path.dirname(os.path.dirname(os.path.dirname(roots["RUN"])))
        if status.get("command"):
            status["command"] = recorded_form(status["command"], roots)
        write_text_atomic(os.path.join(folder, "status.json"), json.dumps(status, indent=2) + "\n")
        changed += 1
        log = os.path.join(folder, "train.log")
        if os.path.exists(log):
            with open(log, encoding="utf-8", errors="surrogateescape") as f:
                old = f.read()
            new = portable_text(portable_text(old, {**roots, "RUNS": runs}), default_roots())
            if new != old:
                with open(log, "w", encoding="utf-8", errors="surrogateescape") as f:
                    f.write(new)
                changed += 1
        echo(f"[portable] {folder}")
    return changed


if __name__ == "__main__":
    for path in sys.argv[1:] or [os.path.join(PROJECT_DIR, "runs")]:
        print(f"[portable] {migrate_runs(path, lambda line: None)} file(s) rewritten under {path}")
