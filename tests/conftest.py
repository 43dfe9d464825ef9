"""Shared fixtures: a tiny synthetic parallel corpus, raw and binarized (joined dictionary)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN_DIR = os.path.dirname(sys.executable)
SHARED_DATA = os.path.join(os.path.dirname(REPO), "shared", "data")


def cli(name: str) -> str:
    """Path of a console script of the running environment (fairseq-train, ...)."""
    return os.path.join(BIN_DIR, name)


def run_cli(args, cwd=REPO, check=True, timeout=900, env=None):
    """Run a command, return the CompletedProcess; on failure show its output."""
    proc = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(map(str, args))}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def tiny_raw(tmp_path_factory):
    """Raw synthetic corpus: 2,000 train / 100 valid / 100 test pairs, langs src/tgt."""
    from fairseq_normplug.synthetic_corpus import write_corpus

    return write_corpus(str(tmp_path_factory.mktemp("raw")), train=2000, valid=100, test=100,
                        vocab_size=60)


@pytest.fixture(scope="session")
def tiny_bin(tiny_raw, tmp_path_factory):
    """``tiny_raw`` binarized by fairseq-preprocess with a joined dictionary."""
    dest = str(tmp_path_factory.mktemp("bin"))
    run_cli([
        cli("fairseq-preprocess"), "--source-lang", "src", "--target-lang", "tgt",
        "--trainpref", f"{tiny_raw}/train", "--validpref", f"{tiny_raw}/valid",
        "--testpref", f"{tiny_raw}/test", "--destdir", dest, "--joined-dictionary",
        "--workers", "1",
    ])
    return dest
