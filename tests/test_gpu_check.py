"""scripts/gpu_check.sh's logic on CPU: the test mode end to end at toy sizes, the refusal
without CUDA, and the verdicts on broken runs."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from fairseq_normplug.bench import gpu_check
from fairseq_normplug.bench.gpu_check import Deadline, Report
from fairseq_normplug.command_start import commands_started_by
from inprocess import ForkedCommand, forked_commands


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only without a CUDA device")
def test_refuses_in_one_line_without_cuda(tmp_path, capsys):
    """In this process: the exit status is main's return value (``sys.exit(main())``)."""
    returncode = gpu_check.main(["--out", str(tmp_path / "r.md")])
    stderr = capsys.readouterr().err
    assert returncode == 2
    assert stderr.strip().splitlines() == [stderr.strip()]
    assert "no CUDA device" in stderr and "--device cpu" in stderr
    assert not os.listdir(tmp_path)


#: what a forked child keeps for its life (it ends by os._exit: nothing is restored)
CHILD_STATE = []


def its_commands_forked_too() -> None:
    """In a forked child, before its command: the commands it starts (bench_train's trainings) are
    forks of it in turn (it runs no other thread)."""
    forked = forked_commands()
    forked.__enter__()
    CHILD_STATE.append(forked)  # a collected context manager would restore the real processes


def forked_commands_of_the_check(monkeypatch):
    """Context manager: every command the check starts (train_half's trainings, fairseq-generate,
    the two benchmarks and bench_train's trainings) a fork of this process or of its forked child
    (tests/inprocess.py's ForkedCommand: the start-up of Python, torch and fairseq spared). The
    trainer thread forks only once norm_paths has ended in this thread (which then only waits for
    it), never while this one computes: a fork then could copy a lock the computing thread holds.
    The trainings start a moment later than in a real run; what they do is the same."""
    caller = threading.current_thread()
    norm_paths_ended = threading.Event()
    run_norm_paths = gpu_check.run_norm_paths

    def run_norm_paths_then_say_so(*args):
        try:
            return run_norm_paths(*args)
        finally:
            norm_paths_ended.set()

    monkeypatch.setattr(gpu_check, "run_norm_paths", run_norm_paths_then_say_so)

    def start(command, **popen_options):
        if threading.current_thread() is not caller:
            norm_paths_ended.wait()
        return ForkedCommand(command, at_start=its_commands_forked_too, **popen_options)

    return commands_started_by(start)


@pytest.mark.slow
def test_cpu_test_mode_end_to_end(tiny_bin, tmp_path, monkeypatch):
    out = tmp_path / "report" / "gpu_check.md"
    with forked_commands_of_the_check(monkeypatch):
        status = gpu_check.main(["--device", "cpu", "--data", tiny_bin, "--workdir",
                                 str(tmp_path / "work"), "--out", str(out), "--budget-s", "3000"])
    report = json.loads(out.with_suffix(".json").read_text())
    failed = [c for c in report["checks"] if c["status"] != "pass"]
    assert status == 0 and report["status"] == "pass", failed
    assert sorted(os.listdir(out.parent)) == ["gpu_check.json", "gpu_check.md"]  # no temp files
    by_section = {}
    for check in report["checks"]:
        by_section.setdefault(check["section"], []).append(check)
    # every section reported (train_half runs in a thread beside norm_paths, so the JSON lists
    # checks as they finish); the report prints the sections in their fixed order
    assert set(by_section) == set(gpu_check.SECTIONS)
    text = out.read_text()
    headings = [text.index(f"\n## {section}\n") for section in gpu_check.SECTIONS]
    assert headings == sorted(headings)

    norms = {c["name"]: c["numbers"] for c in by_section["norm_paths"]}
    fast = ("scalenorm", "rmsnorm", "dyt", "dyt-hardtanh", "dyt-sigmoid")
    assert {f"{name} {dtype}" for name in fast for dtype in gpu_check.DTYPES} <= set(norms)
    dtypes = [name.rsplit(" ", 1)[1] for name in norms]
    assert dtypes == sorted(dtypes, key=gpu_check.DTYPES.index)  # one dtype after the other
    assert norms["scalenorm float32"]["path"] == "native" and norms["derf float32"]["path"] == "plain"
    assert norms["dyt-sigmoid float16"]["value_err"] < 2e-3
    for name, numbers in norms.items():
        dtype = name.rsplit(" ", 1)[1]
        value_tol, grad_tol = gpu_check.TOLERANCE[dtype]
        assert numbers["out_dtype"] == dtype and numbers["finite"], name
        assert numbers["value_err"] <= value_tol and numbers["grad_err"] <= grad_tol, name
        if dtype != "float32":  # a half-precision computation, compared with float32's
            assert numbers["grad_err"] > 0, name

    train = {c["name"]: c["numbers"] for c in by_section["train_half"]}
    assert set(train) == {"postnorm-layernorm", gpu_check.FIXNORM_ROW}
    for numbers in train.values():
        assert numbers["updates"] == 8 and numbers["last_loss"] < numbers["first_loss"]

    (generate,) = by_section["generate"]
    assert generate["numbers"]["hypotheses"] == generate["numbers"]["sentences"] == 100
    assert generate["numbers"]["tok_s"] > 0

    bench = {c["name"]: c["numbers"] for c in by_section["bench_norms"]}
    assert bench["rmsnorm 4x2x16 bfloat16"]["f+b/LN"] > 0
    trains = {c["name"]: c["numbers"] for c in by_section["bench_train"]}
    assert trains["stock"]["vs_stock"] == 1.0 and trains["off"]["tok_s"] > 0
    # bench_train trained on the check's corpus (--data), not on a second one of its own
    assert not [n for n in os.listdir(tmp_path / "work") if n.startswith(("data-bin", "raw-"))]

    assert "**PASS**" in text
    for section in gpu_check.SECTIONS:
        assert f"## {section}" in text
    assert "| prenorm-scalenorm-fixnorm-smallinit | pass" in text


def test_a_failing_section_does_not_stop_the_others(monkeypatch, tmp_path):
    def broken(*args):
        raise RuntimeError("kernel exploded\nCUDA error: out of memory")

    def fine(report, *args):
        report.add("bench_train", "stock", "pass", {"tok_s": 1.0})

    monkeypatch.setattr(gpu_check, "run_norm_paths", broken)
    monkeypatch.setattr(gpu_check, "run_bench_norms", broken)
    monkeypatch.setattr(gpu_check, "run_bench_train", fine)
    out = tmp_path / "r.md"
    status = gpu_check.main(["--device", "cpu", "--sections", "norm_paths,bench_norms,bench_train",
                             "--workdir", str(tmp_path), "--out", str(out)])
    checks = json.loads(out.with_suffix(".json").read_text())["checks"]
    assert status == 1
    assert [(c["section"], c["status"]) for c in checks] == [
        ("norm_paths", "fail"), ("bench_norms", "fail"), ("bench_train", "pass")]
    assert checks[0]["detail"] == "RuntimeError: CUDA error: out of memory"
    assert "**FAIL**: 1 pass, 2 fail" in out.read_text()


def train_log(losses, last_update):
    lines = [f'2026 | INFO | train_inner | {{"loss": "{v}", "num_updates": "{(i + 1) * 10}", '
             f'"wps": "1000", "loss_scale": "{2 ** (7 - i)}"}}' for i, v in enumerate(losses)]
    return "\n".join(lines + [f'x | INFO | train | {{"train_num_updates": "{last_update}"}}'])


def test_training_verdicts():
    good = gpu_check.judge_training(train_log([9.1, 7.2, 5.0], 30), 0, 30)
    assert good["status"] == "pass"
    assert good["numbers"] == {"updates": 30, "first_loss": 9.1, "last_loss": 5.0,
                               "tok_s": 1000, "min_loss_scale": 32.0}
    nan = gpu_check.judge_training(train_log([9.1, "nan", 5.0], 30), 0, 30)
    assert (nan["status"], nan["detail"]) == ("fail", "non-finite loss")
    flat = gpu_check.judge_training(train_log([9.1, 9.3], 20), 0, 20)
    assert "loss did not decrease (9.100 -> 9.300)" in flat["detail"]
    short = gpu_check.judge_training(train_log([9.1, 7.0], 20), 0, 200)
    assert short["detail"] == "stopped at update 20 of 200"
    crashed = gpu_check.judge_training(train_log([9.1], 10) + "\nFloatingPointError: Minimum "
                                       "loss scale reached (0.0001).", 1, 200)
    assert crashed["status"] == "fail" and "exit status 1: FloatingPointError" in crashed["detail"]


def test_generation_verdicts():
    out = "S-0\ta b\nH-0\t-0.5\tx y\nS-1\tc\nH-1\t-0.7\tz\n"
    err = ("Translated 2 sentences (5 tokens) in 0.1s (20.00 sentences/s, 50.00 tokens/s)\n"
           "Generate test with beam=4: BLEU4 = 12.34, 50.0/20.0/10.0/5.0")
    good = gpu_check.judge_generation(out, err, 0)
    assert good["status"] == "pass"
    assert good["numbers"] == {"sentences": 2, "hypotheses": 2, "tok_s": 50.0, "bleu": 12.34}
    nan = gpu_check.judge_generation(out.replace("-0.7", "nan"), err, 0)
    assert nan["detail"] == "non-finite hypothesis scores"
    lost = gpu_check.judge_generation("S-0\ta\nS-1\tb\nH-0\t-1\tx\n", "AssertionError: 200 < 200",
                                      1)
    assert lost["detail"] == ("exit status 1: AssertionError: 200 < 200; "
                              "1 hypotheses for 2 sentences")


def test_runs_past_the_budget_are_skipped_not_started(tmp_path):
    report = Report()
    jobs = [{"name": f"run{i}", "cmd": [sys.executable, "-c", "raise SystemExit(3)"],
             "log": str(tmp_path / f"{i}.log"), "updates": 1} for i in range(2)]
    gpu_check.run_trainings(report, jobs, 1, Deadline(0))
    assert [(c["name"], c["status"]) for c in report.checks] == [("run0", "skipped"),
                                                                 ("run1", "skipped")]
    assert not report.passed()


def test_a_decoding_past_its_deadline_is_killed_and_recorded_as_a_timeout(tmp_path):
    """run_generate's command, started through the seam (here a 60 s sleep in its place), is
    killed when its section's deadline passes (run_command's timeout): a timeout, not a hang."""
    checkpoint = tmp_path / "checkpoint_last.pt"
    checkpoint.write_bytes(b"")
    started = []

    def sleep_instead(command, **popen_options):
        started.append(subprocess.Popen(["sleep", "60"], **popen_options))
        return started[-1]

    report = Report()
    with commands_started_by(sleep_instead):
        gpu_check.run_generate(report, str(tmp_path), str(checkpoint), "fp32", torch.device("cpu"), Deadline(0))
    assert [(c["name"], c["status"], c["detail"]) for c in report.checks] == [
        (f"fairseq-generate {gpu_check.FIXNORM_ROW}", "timeout", "killed at the section deadline")]
    assert started[0].returncode == -9  # killed (SIGKILL), and waited for
