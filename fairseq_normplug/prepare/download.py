"""Resumable downloads and file fingerprints.

:func:`fetch` downloads into ``NAME.part``, resuming an earlier partial download with an HTTP
``Range`` request, checks the received size against the size the server announced, and only
then renames the file to ``NAME`` and writes ``NAME.download.json`` (URL, size, sha256). A
file already in place is reused without any network access (its size is checked against that
record when there is one), so a finished download is never fetched twice.
"""
import hashlib
import http.client
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

from tqdm import tqdm

from fairseq_normplug.atomic_files import move_into_place
from fairseq_normplug.errors import NormplugError

CHUNK_BYTES = 1 << 20
ATTEMPTS = 3
TIMEOUT_S = 60
_USER_AGENT = "fairseq-normplug-prepare/1 (python urllib)"


def sha256_of(path: str) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(path: str) -> dict:
    """Provenance of an input file for a manifest: absolute path, size and sha256 (reusing
    the record that :func:`fetch` wrote beside a download)."""
    record = _read_record(path)
    if record is not None and record.get("size") == os.path.getsize(path):
        return {"path": os.path.abspath(path), "url": record["url"], "size": record["size"],
                "sha256": record["sha256"]}
    return {"path": os.path.abspath(path), "size": os.path.getsize(path), "sha256": sha256_of(path)}


def fetch(url: str, path: str, log: Callable[[str], None]) -> str:
    """Make ``path`` hold the complete file at ``url``; return ``path``.

    Skips the download when ``path`` exists; resumes ``path.part``; retries a broken
    transfer :data:`ATTEMPTS` times (each try resumes). Raises :class:`NormplugError` when
    the file cannot be obtained, naming the way to supply it by hand.
    """
    if os.path.exists(path):
        record = _read_record(path)
        if record is not None and record.get("size") != os.path.getsize(path):
            raise NormplugError(
                f"{path} has {os.path.getsize(path)} bytes but was downloaded with "
                f"{record['size']}: the file was changed or truncated; delete it to download again")
        log(f"using {path} (already downloaded)")
        return path
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    part = path + ".part"
    problem = ""
    for attempt in range(1, ATTEMPTS + 1):
        have = os.path.getsize(part) if os.path.exists(part) else 0
        log(f"downloading {url}" + (f" (resuming at {have} bytes)" if have else ""))
        try:
            total = _transfer(url, part, have)
        except urllib.error.HTTPError as exc:
            raise NormplugError(f"cannot download {url}: HTTP {exc.code} {exc.reason}; "
                                f"download it yourself and pass its local path") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            problem = f"cannot download {url}: {reason}"
        else:
            size = os.path.getsize(part)
            if total is None or size == total:
                break
            if size > total:
                os.remove(part)
                raise NormplugError(f"download of {url} is larger than announced ({size} > {total} "
                                    "bytes); removed it, run again to restart")
            problem = f"download of {url} stopped at {size} of {total} bytes"
        if attempt < ATTEMPTS:
            time.sleep(attempt)
    else:
        raise NormplugError(f"{problem}; run again to resume, or download it yourself and pass "
                            "its local path")
    record = {"url": url, "size": os.path.getsize(part), "sha256": sha256_of(part)}
    move_into_place(part, path)
    with open(_record_path(path), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return path


def _transfer(url: str, part: str, have: int) -> Optional[int]:
    """One HTTP request appending to ``part`` from byte ``have``; returns the full size the
    server announced (None if it did not say)."""
    headers = {"User-Agent": _USER_AGENT}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # nothing left to send: the part is already whole
            return have
        raise
    with response:
        total = None
        if have and response.status == 206:
            match = re.search(r"/(\d+)$", response.headers.get("Content-Range", ""))
            total = int(match.group(1)) if match else None
            mode = "ab"
        else:
            have, mode = 0, "wb"
            length = response.headers.get("Content-Length")
            total = int(length) if length is not None else None
        with open(part, mode) as out, tqdm(
            total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024,
            desc=os.path.basename(part[:-len(".part")]), file=sys.stderr, disable=None,
        ) as bar:
            for block in iter(lambda: response.read(CHUNK_BYTES), b""):
                out.write(block)
                bar.update(len(block))
    return total


def _record_path(path: str) -> str:
    return path + ".download.json"


def _read_record(path: str) -> Optional[dict]:
    try:
        with open(_record_path(path), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
