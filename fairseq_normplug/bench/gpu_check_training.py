"""The GPU check's end-to-end part: short fairseq-train runs of the table's rows in each
precision, judged by their logs (the loss fell, no overflow, every update done), and
fairseq-generate on a trained checkpoint, judged by its speed and BLEU."""
import math
import os
import re
import subprocess
import time
from typing import Dict, List, Optional

import torch

from fairseq_normplug.bench.check_report import Deadline, Report
from fairseq_normplug.command_start import run_command, start_command
from fairseq_normplug.experiments.training_log import json_records
from fairseq_normplug.fairseq_commands import fairseq_command


#: the paper's main rows (Nguyen & Salazar Table 1-2) and the DyT row; FIXNORM_ROW is decoded
ROWS = {
    "postnorm-layernorm": [],
    "prenorm-layernorm": ["--prenorm"],
    "prenorm-scalenorm-fixnorm-smallinit": ["--prenorm", "--scalenorm", "--fixnorm",
                                            "--smallinit"],
    "prenorm-dyt": ["--prenorm", "--dyt"],
}
FIXNORM_ROW = "prenorm-scalenorm-fixnorm-smallinit"
PRECISION_FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}


def train_command(data: str, row: str, precision: str, cfg: Dict, device: torch.device,
                  save_dir: Optional[str]) -> List[str]:
    flags = list(ROWS[row])
    if "--fixnorm" in flags:
        flags.append("--share-all-embeddings")
    save = ["--save-dir", save_dir, "--no-epoch-checkpoints"] if save_dir else ["--no-save"]
    return fairseq_command(
        "fairseq-train", data, "--arch", cfg["arch"], *flags,
        *PRECISION_FLAGS[precision], *(["--cpu"] if device.type == "cpu" else []),
        "--task", "translation", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
        "--lr", str(cfg["lr"]), "--lr-scheduler", "inverse_sqrt", "--warmup-updates",
        str(max(1, cfg["updates"] // 2)), "--criterion", "label_smoothed_cross_entropy",
        "--label-smoothing", "0.1", "--clip-norm", "1.0", "--max-tokens", str(cfg["max_tokens"]),
        "--seed", "1", "--max-update", str(cfg["updates"]), "--log-format", "json",
        "--log-interval", str(cfg["log_interval"]), "--disable-validation", "--num-workers", "0",
        "--required-batch-size-multiple", "1", *save)


def judge_training(log: str, returncode: int, updates: int) -> Dict:
    """Status, numbers and detail of one training run from its log."""
    inner = json_records(log, "train_inner")
    losses = [float(r["loss"]) for r in inner]
    last_update = max([int(r["num_updates"]) for r in inner]
                      + [int(r["train_num_updates"]) for r in json_records(log, "train")] or [0])
    numbers = {"updates": last_update, "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None}
    wps = [float(r["wps"]) for r in inner[1:]]  # the first interval holds start-up
    if wps:
        numbers["tok_s"] = round(sum(wps) / len(wps))
    if inner and "loss_scale" in inner[-1]:
        numbers["min_loss_scale"] = min(float(r.get("loss_scale", "inf")) for r in inner)
    problems = []
    if returncode != 0:
        tail = [line for line in log.strip().splitlines() if line.strip()][-1:] or [""]
        problems.append(f"exit status {returncode}: {tail[0][-300:]}")
    if len(losses) < 2:
        problems.append(f"{len(losses)} logged losses")
    elif not all(math.isfinite(v) for v in losses):
        problems.append("non-finite loss")
    elif not losses[-1] < losses[0]:
        problems.append(f"loss did not decrease ({losses[0]:.3f} -> {losses[-1]:.3f})")
    if last_update < updates and returncode == 0:
        problems.append(f"stopped at update {last_update} of {updates}")
    return {"status": "fail" if problems else "pass", "numbers": numbers,
            "detail": "; ".join(problems)}


def run_trainings(report: Report, jobs: List[Dict], at_once: int, deadline: Deadline,
                  section: str = "train_half") -> None:
    """Run ``jobs`` (name, cmd, log, updates) ``at_once`` at a time; a run still going at the
    deadline is killed (timeout), one not started is skipped."""
    waiting, running = list(jobs), []
    while waiting or running:
        while waiting and len(running) < at_once:
            job = waiting.pop(0)
            if deadline.left() <= 0:
                report.add(section, job["name"], "skipped", detail="section budget spent")
                continue
            log = open(job["log"], "w")
            env = {**os.environ, "PYTHONWARNINGS": "ignore",
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
            proc = start_command(job["cmd"], stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((job, proc, log, time.time()))
        time.sleep(0.2)
        for entry in list(running):
            job, proc, log, start = entry
            timed_out = proc.poll() is None and deadline.left() <= 0
            if timed_out:
                proc.kill()
                proc.wait()
            if proc.poll() is None:
                continue
            running.remove(entry)
            log.close()
            with open(job["log"]) as f:
                text = f.read()
            verdict = judge_training(text, proc.returncode, job["updates"])
            if timed_out:
                verdict["status"] = "timeout"
                verdict["detail"] = (f"killed at the section deadline after update "
                                     f"{verdict['numbers']['updates']}")
            report.add(section, job["name"], verdict["status"], verdict["numbers"],
                       verdict["detail"], time.time() - start)


TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s "
                        r"\(([\d.]+) sentences/s, ([\d.]+) tokens/s\)")


def judge_generation(stdout: str, stderr: str, returncode: int) -> Dict:
    sources = [line for line in stdout.splitlines() if line.startswith("S-")]
    hyps = [line.split("\t") for line in stdout.splitlines() if line.startswith("H-")]
    scores = [float(h[1]) for h in hyps if len(h) > 1]
    numbers = {"sentences": len(sources), "hypotheses": len(hyps)}
    match = TRANSLATED.search(stdout + stderr)
    if match:
        numbers["tok_s"] = float(match.group(5))
    bleu = re.search(r"BLEU4? = ([\d.]+)", stdout + stderr)
    if bleu:
        numbers["bleu"] = float(bleu.group(1))
    problems = []
    if returncode != 0:
        tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or [""]
        problems.append(f"exit status {returncode}: {tail[0][-300:]}")
    if not hyps or len(hyps) != len(sources):
        problems.append(f"{len(hyps)} hypotheses for {len(sources)} sentences")
    if not all(math.isfinite(s) for s in scores):
        problems.append("non-finite hypothesis scores")
    return {"status": "fail" if problems else "pass", "numbers": numbers,
            "detail": "; ".join(problems)}


def run_generate(report: Report, data: str, checkpoint: str, precision: str,
                 device: torch.device, deadline: Deadline) -> None:
    name = " ".join(["fairseq-generate", *PRECISION_FLAGS[precision], FIXNORM_ROW])
    if not os.path.exists(checkpoint):
        report.add("generate", name, "fail", detail=f"no checkpoint: {FIXNORM_ROW} training "
                                                    f"did not save {checkpoint}")
        return
    cmd = fairseq_command("fairseq-generate", data, "--path", checkpoint,
                          *PRECISION_FLAGS[precision], *(["--cpu"] if device.type == "cpu" else []),
                          "--beam", "4", "--gen-subset", "test", "--max-tokens", "8000",
                          "--required-batch-size-multiple", "1")
    start = time.time()
    try:
        proc = run_command(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=max(1, deadline.left()), env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        report.add("generate", name, "timeout", detail="killed at the section deadline",
                   seconds=time.time() - start)
        return
    verdict = judge_generation(proc.stdout, proc.stderr, proc.returncode)
    report.add("generate", name, verdict["status"], verdict["numbers"], verdict["detail"],
               time.time() - start)
