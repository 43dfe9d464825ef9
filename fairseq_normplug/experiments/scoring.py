"""Scoring a trained run: the test set translated with its best checkpoint, then tokenized
BLEU, sacreBLEU and chrF with their signatures (scores.json)."""
import glob
import os
import subprocess
from typing import Callable, List, Optional

from fairseq_normplug import checkpoint_safety
from fairseq_normplug.atomic_files import move_into_place
from fairseq_normplug.checkpoint_compat import safe_load
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu
from fairseq_normplug.experiments.processes import run_process
from fairseq_normplug.experiments.run_commands import generate_command
from fairseq_normplug.experiments.run_records import read_scores, write_json_atomic
from fairseq_normplug.experiments.runs import Run


def selected_checkpoint(checkpoint: str) -> dict:
    """The update and dev BLEU of the validation ``checkpoint`` (checkpoint_best.pt) was saved at,
    read with the plugin's safe loader (``weights_only=True``: no code in the file runs)."""
    state = safe_load(checkpoint)
    return {"selected_update": state["optimizer_history"][-1]["num_updates"],
            "dev_bleu": state.get("extra_state", {}).get("val_loss")}


def evaluate(run: Run, echo: Callable[[str], None] = print) -> Optional[dict]:
    """Translate the test set with the best checkpoint and score it; None if not trained.
    ``generate-test.txt`` and ``scores.json`` appear complete or not at all; a killed
    decoding's temporary output is deleted and decoding starts again."""
    scores_path = run.path("scores.json")
    if read_scores(scores_path) is not None:
        return read_scores(scores_path)
    checkpoint = run.path("checkpoints", "checkpoint_best.pt")
    if run.status()["status"] != "done" or not os.path.exists(checkpoint):
        return None
    if checkpoint_safety.read_checkpoint(checkpoint) is None:
        raise NormplugError(f"{checkpoint} is incomplete (the disk filled up or it was copied in part); "
                            f"train {run.label} again from scratch: delete {run.run_dir}")
    output = run.path("generate-test.txt")
    for leftover in glob.glob(f"{output}.tmp-*"):  # a killed decoding's partial output
        os.remove(leftover)
    tmp = f"{output}.tmp-{os.getpid()}"
    command = generate_command(run, checkpoint)
    echo(f"[{run.label}] translating the test set")
    with open(tmp, "w", encoding="utf-8") as out:
        with run_process(run, "decoder", command, stdout=out, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **run.env()}) as proc:
            _, errors = proc.communicate()
    if proc.returncode != 0:
        os.remove(tmp)
        last = errors.strip().splitlines()[-1] if errors.strip() else f"exit {proc.returncode}"
        raise NormplugError(f"fairseq-generate failed for {run.label}: {last}")
    move_into_place(tmp, output)
    scores = {**score_generation(output, run.data_dir, run.tgt), **selected_checkpoint(checkpoint)}
    write_json_atomic(scores_path, scores)
    echo(f"[{run.label}] update {scores['selected_update']} (dev BLEU {scores['dev_bleu']}): test BLEU "
         f"{scores['tokenized_bleu']:.2f} (tokenized), sacreBLEU {scores['sacrebleu']:.2f}, chrF {scores['chrf']:.2f}")
    return scores


def test_references(data_dir: str, tgt: str):
    """(tokenized references, detokenized references or None) of a prepared data folder."""
    refs_tok = bleu.read_lines(os.path.join(data_dir, "ref", f"test.tok.{tgt}"))
    detok_path = os.path.join(data_dir, "ref", f"test.detok.{tgt}")
    return refs_tok, bleu.read_lines(detok_path) if os.path.exists(detok_path) else None


def test_hypotheses(run: "Run", expected: int) -> List[str]:
    return bleu.read_fairseq_generate(run.path("generate-test.txt"), expected=expected).hypotheses


def score_generation(generate_output: str, data_dir: str, tgt: str) -> dict:
    """Tokenized BLEU (the paper's), detokenized sacreBLEU and chrF/chrF++ with signatures and,
    for German targets, the WMT recipe's compound-split BLEU."""
    refs_tok, refs_detok = test_references(data_dir, tgt)
    hyps = bleu.read_fairseq_generate(generate_output, expected=len(refs_tok)).hypotheses
    return bleu.score_translation(hyps, refs_tok, lang=tgt, detok_refs=refs_detok,
                                  compound_split=tgt == "de")
