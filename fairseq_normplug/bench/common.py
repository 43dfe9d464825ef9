"""Helpers shared by the benchmarks: machine description, load check, table output."""
import json
import os
import platform
import statistics
from typing import Dict, List, Sequence

import torch

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


def load_warning(before: float, after: float, cpus: int = os.cpu_count() or 1) -> str:
    """A warning line when other work competed for the CPUs during the run."""
    if max(before, after) > 0.5 * cpus:
        return (f"WARNING: load average {before:.2f} -> {after:.2f} on {cpus} CPUs: other "
                f"processes were running; absolute times are inflated and ratios noisier. "
                f"Re-run on a quiet machine before quoting numbers.")
    return ""


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def markdown_table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    lines = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(lines + [fmt(r) for r in rows])


def write_results(out: str, text: str, data: Dict) -> None:
    """Write ``text`` (markdown) to ``out`` and ``data`` as JSON beside it (``.json``)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(data, f, indent=1)
