"""Reading text members out of (gzipped) tar archives in one sequential pass.

The whole archive is always read to its end, so a truncated or corrupt download is reported
as such even when the members we need come first.
"""
import os
import tarfile
import zlib
from typing import Callable, Dict, Iterable

from fairseq_normplug.errors import NormplugError


def read_members(archive: str, handlers: Dict[str, Callable[[Iterable[str]], None]]) -> None:
    """Call ``handlers[suffix](lines)`` for the member whose name ends with ``/suffix`` (or
    is ``suffix``), ``lines`` being its text lines without the trailing newline.

    Raises :class:`NormplugError` if the archive is missing, unreadable or truncated, or if
    a handler's member is not in it.
    """
    if not os.path.isfile(archive):
        raise NormplugError(f"archive not found: {archive}")
    pending = dict(handlers)
    try:
        with tarfile.open(archive, "r|*") as tar:
            for member in tar:
                suffix = _matching_suffix(member.name, pending)
                if suffix is None or not member.isfile():
                    continue
                handler = pending.pop(suffix)
                handler(line.decode("utf-8").rstrip("\n") for line in tar.extractfile(member))
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise NormplugError(f"{archive} is not a readable tar archive or is truncated ({exc})") from None
    except UnicodeDecodeError as exc:
        raise NormplugError(f"{archive} holds text that is not UTF-8 ({exc})") from None
    if pending:
        raise NormplugError(f"{archive} lacks {', '.join(sorted(pending))}: is it the right archive?")


def _matching_suffix(name: str, suffixes: Iterable[str]):
    for suffix in suffixes:
        if name == suffix or name.endswith("/" + suffix):
            return suffix
    return None
