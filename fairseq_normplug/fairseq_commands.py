"""Command lines of fairseq's programs as this package runs them: the program of the running
Python's environment (``fairseq-train``, ``fairseq-generate``, ``fairseq-preprocess``), its data
folder, this plugin as ``--user-dir``, then the caller's flags."""
import os
import sys
from typing import List

from fairseq_normplug.cli import user_dir
from fairseq_normplug.errors import NormplugError

#: the folder of this Python's programs, where fairseq installed its console scripts
BIN_DIR = os.path.dirname(sys.executable)
#: this package's folder, the value of fairseq's ``--user-dir``
USER_DIR = user_dir()
USER_DIR_FLAGS = ["--user-dir", USER_DIR]
PROGRAMS = ("fairseq-generate", "fairseq-preprocess", "fairseq-train")


def program_path(program: str) -> str:
    """The path of fairseq's ``program`` in this Python's environment."""
    if program not in PROGRAMS:
        raise NormplugError(f"unknown fairseq program {program!r}; one of {', '.join(PROGRAMS)}")
    return os.path.join(BIN_DIR, program)


def fairseq_arguments(data: str, *flags: str, plugin: bool = True) -> List[str]:
    """fairseq's arguments: the ``data`` folder, ``--user-dir`` (unless ``plugin`` is False:
    stock fairseq), then ``flags``."""
    return [data, *(USER_DIR_FLAGS if plugin else []), *flags]


def fairseq_command(program: str, data: str, *flags: str, plugin: bool = True) -> List[str]:
    """The command line of fairseq's ``program`` on ``data``: :func:`program_path` then
    :func:`fairseq_arguments`."""
    return [program_path(program), *fairseq_arguments(data, *flags, plugin=plugin)]
