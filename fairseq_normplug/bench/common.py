"""Helpers shared by the benchmarks: machine description, load check, table output."""
import json
import os
import platform
import resource
import statistics
import time
from typing import Dict, List, Sequence

import torch

from fairseq_normplug.atomic_files import write_text_atomic

DEFAULT_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "results")


def load_average() -> float:
    """1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def machine_line() -> str:
    """One line naming what the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads){gpu}, python {platform.python_version()}")


class OtherProcesses:
    """Measures how much CPU time processes other than this one (and its children) used
    since construction, as a share of all CPUs; None where /proc/stat is missing."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        own = sum(getattr(resource.getrusage(who), attr)
                  for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for attr in ("ru_utime", "ru_stime"))
        return busy, own, time.time()

    def share(self):
        end = self._sample()
        if self.start is None or end is None:
            return None
        busy, own, wall = (b - a for a, b in zip(self.start, end))
        return max(0.0, (busy - own) / (wall * (os.cpu_count() or 1)))


def load_warning(other_share) -> str:
    """A warning line when other processes used more than 10% of the CPUs during the run."""
    if other_share is not None and other_share > 0.1:
        return (f"WARNING: other processes used {100 * other_share:.0f}% of the CPUs during "
                f"this run; absolute times are inflated and ratios noisier. Re-run on a quiet "
                f"machine before quoting numbers.")
    return ""


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def markdown_table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    lines = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(lines + [fmt(r) for r in rows])


#: glibc allocator settings for steadier numbers: freed blocks of up to 32 MB (glibc's largest
#: allowed threshold) stay in the heap instead of being unmapped, so the next tensor of that
#: size is not page-faulted in again (hundreds of faults per 8 MB tensor, at random)
STEADY_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "68719476736"}


def steady_allocator_env() -> bool:
    """Put :data:`STEADY_ALLOCATOR` into ``os.environ`` where unset, for the child processes
    a benchmark starts; True when this process itself started with them (glibc reads them
    once, at start-up)."""
    started_with = all(name in os.environ for name in STEADY_ALLOCATOR)
    for name, value in STEADY_ALLOCATOR.items():
        os.environ.setdefault(name, value)
    return started_with


def publish(out: str, text: str, data: Dict) -> None:
    """Write the table and the raw numbers (:func:`write_results`) and print the table."""
    write_results(out, text, data)
    print(text)
    print(f"written to {out}")


def write_results(out: str, text: str, data: Dict) -> None:
    """Write ``text`` (markdown) to ``out`` and ``data`` as JSON beside it (``.json``), each
    through :func:`write_text_atomic`: never a half-written table."""
    write_text_atomic(out, text)
    write_text_atomic(os.path.splitext(out)[0] + ".json", json.dumps(data, indent=1))
