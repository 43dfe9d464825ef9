"""Training-log parsing and the papers' figures, from real tiny fairseq-train logs."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO, cli, run_cli
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import figures
from fairseq_normplug.experiments.training_log import parse_training_log

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NORMS = ["enc0.attn", "enc0.ffn", "enc1.attn", "enc1.ffn", "enc.final",
         "dec0.attn", "dec0.cross", "dec0.ffn", "dec1.attn", "dec1.cross", "dec1.ffn", "dec.final"]
# The command, made cheaper: validation on one batch, short generations.
TRAIN = [
    "--user-dir", os.path.join(REPO, "fairseq_normplug"), "--arch", "transformer_normplug_tiny",
    "--prenorm", "--norm-stats-interval", "5", "--log-format", "json", "--log-interval", "5",
    "--max-update", "30", "--cpu", "--num-workers", "0", "--optimizer", "adam", "--lr", "1e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--criterion", "label_smoothed_cross_entropy", "--max-tokens", "1000",
    "--validate-interval-updates", "10", "--max-valid-steps", "1",
    "--required-batch-size-multiple", "1", "--no-save",
]
EVAL_BLEU = ["--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}']
RUNS = {
    "ScaleNorm": ["--scalenorm", "--fixnorm", "--label-smoothing", "0.1", *EVAL_BLEU],
    "DyT": ["--dyt", "--label-smoothing", "0.1", *EVAL_BLEU],
    "ScaleNorm-noLS": ["--scalenorm", "--fixnorm", "--label-smoothing", "0"],
}


@pytest.fixture(scope="module")
def log_paths(tiny_bin, tmp_path_factory):
    """{label: log file} of three 30-update runs, trained side by side (one thread each)."""
    out = tmp_path_factory.mktemp("training_logs")

    def train(label):
        proc = run_cli([cli("fairseq-train"), tiny_bin, *TRAIN, *RUNS[label], "--save-dir", str(out / label)],
                       env={"OMP_NUM_THREADS": "1"})
        path = out / f"{label}.log"
        path.write_text(proc.stdout, encoding="utf-8")
        return label, str(path)

    with ThreadPoolExecutor(len(RUNS)) as pool:
        return dict(pool.map(train, RUNS))


@pytest.fixture(scope="module")
def logs(log_paths):
    return {label: parse_training_log(path) for label, path in log_paths.items()}


def raw_records(path, kind):
    """The JSON records of one kind, read without the parser under test."""
    marker = f"| {kind} | "
    with open(path, encoding="utf-8") as f:
        return [json.loads(line.split(marker, 1)[1]) for line in f if marker in line]


def assert_png(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_training_log_parsing(logs, log_paths):
    scale = logs["ScaleNorm"]
    assert [r["num_updates"] for r in scale.kind("train_inner")] == [5.0, 10.0, 15.0, 20.0, 25.0, 30.0]
    assert [r["valid_num_updates"] for r in scale.kind("valid")] == [10.0, 20.0, 30.0]
    assert scale.last_update == 30
    assert (scale.criterion, scale.label_smoothing) == ("label_smoothed_cross_entropy", 0.1)
    assert logs["ScaleNorm-noLS"].label_smoothing == 0.0
    assert scale.skipped_lines == 0

    last = raw_records(log_paths["ScaleNorm"], "train_inner")[-1]
    assert scale.latest("train_inner", "g:") == {name: float(last[f"g:{name}"]) for name in NORMS}
    updates, gnorm = scale.series("train_inner", "gnorm")
    assert gnorm == [float(r["gnorm"]) for r in raw_records(log_paths["ScaleNorm"], "train_inner")]
    assert set(logs["DyT"].latest("train_inner", "alpha:")) == set(NORMS)
    assert "valid_bleu" not in logs["ScaleNorm-noLS"].keys("valid")


def test_garbage_truncation_and_resumed_runs(log_paths, tmp_path):
    lines = open(log_paths["ScaleNorm"], encoding="utf-8").read().splitlines()
    inner = [line for line in lines if "| train_inner |" in line]
    resumed = inner[3].replace('"num_updates": "20"', '"num_updates": "20", "resumed": "1"')
    path = tmp_path / "resumed.log"
    path.write_text("\n".join(
        ["binary \x00 junk | INFO | train_inner | {not json}", *lines,
         "fairseq_cli.train | nothing useful", resumed, inner[4][: len(inner[4]) // 2]]), encoding="utf-8")
    log = parse_training_log(str(path))
    updates = [r["num_updates"] for r in log.kind("train_inner")]
    assert updates == [5.0, 10.0, 15.0, 20.0, 25.0, 30.0]  # no duplicate, sorted
    assert log.kind("train_inner")[3]["resumed"] == 1.0  # the appended record of update 20 wins
    assert log.skipped_lines == 2  # the junk record and the truncated last line
    with pytest.raises(NormplugError, match="no such training log: .*nothing.log"):
        parse_training_log(str(tmp_path / "nothing.log"))


def test_dev_bleu_and_grad_norm_figures(logs, log_paths, tmp_path):
    bleu = figures.plot_dev_bleu(logs, str(tmp_path / "bleu.png"))
    assert list(bleu) == ["ScaleNorm", "DyT"]  # the run without --eval-bleu is left out
    valid = raw_records(log_paths["DyT"], "valid")
    assert bleu["DyT"] == ([10.0, 20.0, 30.0], [float(r["valid_bleu"]) for r in valid])
    assert_png(tmp_path / "bleu.png")

    gnorm = figures.plot_grad_norm(logs, str(tmp_path / "gnorm.png"))
    assert list(gnorm) == list(logs)
    assert gnorm["DyT"][1] == [float(r["gnorm"]) for r in raw_records(log_paths["DyT"], "train_inner")]
    assert_png(tmp_path / "gnorm.png")


def test_scalenorm_g_figure(logs, log_paths, tmp_path):
    data = figures.plot_scalenorm_g(logs, str(tmp_path / "g.png"))
    assert list(data) == ["ScaleNorm", "ScaleNorm-noLS"]  # DyT has no g
    last = raw_records(log_paths["ScaleNorm"], "train_inner")[-1]
    panels = data["ScaleNorm"]
    assert panels["dec.cross"] == ([0, 1], [float(last["g:dec0.cross"]), float(last["g:dec1.cross"])])
    assert panels["enc.ffn"] == ([0, 1], [float(last["g:enc0.ffn"]), float(last["g:enc1.ffn"])])
    assert panels["final"] == (["enc", "dec"], [float(last["g:enc.final"]), float(last["g:dec.final"])])
    assert set(panels) == {"enc.attn", "enc.ffn", "dec.attn", "dec.cross", "dec.ffn", "final"}
    assert_png(tmp_path / "g.png")


def test_label_smoothing_g_figure(logs, log_paths, tmp_path):
    data = figures.plot_label_smoothing_g(logs, str(tmp_path / "ls.png"))
    decoder = ["dec0.attn", "dec0.cross", "dec0.ffn", "dec1.attn", "dec1.cross", "dec1.ffn", "dec.final"]
    last = raw_records(log_paths["ScaleNorm-noLS"], "train_inner")[-1]
    assert data["ScaleNorm-noLS"] == (decoder, [float(last[f"g:{name}"]) for name in decoder])
    assert list(data) == ["ScaleNorm", "ScaleNorm-noLS"]
    assert_png(tmp_path / "ls.png")
    with pytest.raises(figures.MissingLogData, match="different --label-smoothing"):
        figures.plot_label_smoothing_g({"only": logs["ScaleNorm"]}, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()


def test_dyt_alpha_figure(logs, log_paths, tmp_path):
    data = figures.plot_dyt_alpha(logs, str(tmp_path / "dyt.png"))
    records = raw_records(log_paths["DyT"], "train_inner")
    assert list(data["final_alpha"]) == ["DyT"]
    assert data["final_alpha"]["DyT"] == {name: float(records[-1][f"alpha:{name}"]) for name in NORMS}
    assert list(data["final_alpha"]["DyT"]) == NORMS  # forward order
    assert data["tracked_log"] == "DyT"
    assert list(data["tracked"]) == ["enc0.attn", "dec0.cross", "dec.final"]
    updates, alpha, inverse_std = data["tracked"]["dec.final"]
    assert updates == [float(r["num_updates"]) for r in records]
    assert alpha == [float(r["alpha:dec.final"]) for r in records]
    assert inverse_std == pytest.approx([1 / float(r["in_std:dec.final"]) for r in records])
    assert_png(tmp_path / "dyt.png")


def test_dyt_saturation_figure(logs, log_paths, tmp_path):
    data = figures.plot_dyt_saturation(logs, str(tmp_path / "sat.png"))
    assert list(data) == ["DyT"]  # only DyT norms saturate
    records = raw_records(log_paths["DyT"], "train_inner")
    assert list(data["DyT"]) == NORMS  # forward order
    for name in ("enc0.attn", "dec.final"):
        updates, fractions = data["DyT"][name]
        assert updates == [float(r["num_updates"]) for r in records]
        assert fractions == [float(r[f"sat:{name}"]) for r in records]
        assert all(0 <= f <= 1 for f in fractions)
    assert_png(tmp_path / "sat.png")
    with pytest.raises(figures.MissingLogData, match="sat:<norm>"):
        figures.plot_dyt_saturation({"s": logs["ScaleNorm"]}, str(tmp_path / "none.png"))


def test_command_line_makes_what_the_logs_support(log_paths, tmp_path, capsys):
    out = tmp_path / "figs"
    outcome = figures.main([f"--log={label}={path}" for label, path in log_paths.items()] + ["--out", str(out)])
    assert sorted(os.listdir(out)) == sorted(filename for filename, _ in figures.FIGURES.values())
    for path in outcome.values():
        assert_png(path)

    outcome = figures.main(["--log", f"DyT={log_paths['DyT']}", "--out", str(tmp_path / "dyt_only")])
    assert outcome["scalenorm_g"].startswith("skipped: scalenorm_g: no log has g:<norm> keys")
    assert outcome["label_smoothing_g"].startswith("skipped:")
    assert sorted(os.listdir(tmp_path / "dyt_only")) == ["dyt_alpha.png", "dyt_saturation.png",
                                                         "fig1_dev_bleu.png", "fig2_grad_norm.png"]
    assert "scalenorm_g: skipped: " in capsys.readouterr().out


def test_command_line_bad_input(log_paths, tmp_path):
    with pytest.raises(NormplugError, match="unknown figure 'fig9'"):
        figures.main(["--log", f"DyT={log_paths['DyT']}", "--out", str(tmp_path), "--figures", "fig9"])
    with pytest.raises(NormplugError, match="--log 'DyT': expected LABEL=PATH"):
        figures.main(["--log", "DyT", "--out", str(tmp_path)])
    with pytest.raises(NormplugError, match="no such training log"):
        figures.main(["--log", f"x={tmp_path}/missing.log", "--out", str(tmp_path)])
    with pytest.raises(NormplugError, match="unknown norm name 'dec2.mlp'"):
        figures.norm_sort_key("dec2.mlp")
