"""The GPU check's report (one pass/fail line per check, by section) and its time budget:
each check runs guarded, so that one failing check is reported and the others still run."""
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional


class Report:
    """The checks recorded so far; thread-safe (training runs report from a thread)."""

    def __init__(self):
        self.checks: List[Dict] = []
        self._lock = threading.Lock()

    def add(self, section: str, name: str, status: str, numbers: Optional[Dict] = None,
            detail: str = "", seconds: float = 0.0) -> Dict:
        check = {"section": section, "name": name, "status": status,
                 "numbers": numbers or {}, "detail": detail, "seconds": round(seconds, 2)}
        with self._lock:
            self.checks.append(check)
        return check

    def passed(self) -> bool:
        return bool(self.checks) and all(c["status"] == "pass" for c in self.checks)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def guarded(report: Report, section: str, name: str, fn: Callable[[], None]) -> None:
    """Run ``fn``; an exception becomes a failed check (its last line), never a crash."""
    start = time.time()
    try:
        fn()
    except Exception as error:  # one failing check must not stop the others
        last = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        report.add(section, name, "fail", detail=f"{type(error).__name__}: {last}"[:500],
                   seconds=time.time() - start)
        traceback.print_exc()
