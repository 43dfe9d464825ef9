"""Training-log parsing and the papers' figures, from real tiny fairseq-train logs."""
import json
import os

import pytest
from matplotlib.colors import to_rgb

from conftest import REPO, cli
from inprocess import run_fairseq
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import figures
from fairseq_normplug.experiments.training_log import parse_training_log

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NORMS = ["enc0.attn", "enc0.ffn", "enc1.attn", "enc1.ffn", "enc.final",
         "dec0.attn", "dec0.cross", "dec0.ffn", "dec1.attn", "dec1.cross", "dec1.ffn", "dec.final"]
# The command, made cheaper: batches of 500 tokens, validation on one batch, short generations.
TRAIN = [
    "--user-dir", os.path.join(REPO, "fairseq_normplug"), "--arch", "transformer_normplug_tiny",
    "--prenorm", "--norm-stats-interval", "3", "--log-format", "json", "--log-interval", "3",
    "--max-update", "15", "--cpu", "--num-workers", "0", "--optimizer", "adam", "--lr", "1e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--criterion", "label_smoothed_cross_entropy", "--max-tokens", "500",
    "--validate-interval-updates", "5", "--max-valid-steps", "1",
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
    """{label: log file} of three 15-update runs, trained one after the other in this process."""
    out = tmp_path_factory.mktemp("training_logs")

    def train(label):
        proc = run_fairseq([cli("fairseq-train"), tiny_bin, *TRAIN, *RUNS[label], "--save-dir", str(out / label)])
        path = out / f"{label}.log"
        path.write_text(proc.stdout, encoding="utf-8")
        return label, str(path)

    return dict(train(label) for label in RUNS)


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
    assert [r["num_updates"] for r in scale.kind("train_inner")] == [3.0, 6.0, 9.0, 12.0, 15.0]
    assert [r["valid_num_updates"] for r in scale.kind("valid")] == [5.0, 10.0, 15.0]
    assert scale.last_update == 15
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
    resumed = inner[3].replace('"num_updates": "12"', '"num_updates": "12", "resumed": "1"')
    path = tmp_path / "resumed.log"
    path.write_text("\n".join(
        ["binary \x00 junk | INFO | train_inner | {not json}", *lines,
         "fairseq_cli.train | nothing useful", resumed, inner[4][: len(inner[4]) // 2]]), encoding="utf-8")
    log = parse_training_log(str(path))
    updates = [r["num_updates"] for r in log.kind("train_inner")]
    assert updates == [3.0, 6.0, 9.0, 12.0, 15.0]  # no duplicate, sorted
    assert log.kind("train_inner")[3]["resumed"] == 1.0  # the appended record of update 12 wins
    assert log.skipped_lines == 2  # the junk record and the truncated last line
    with pytest.raises(NormplugError, match="no such training log: .*nothing.log"):
        parse_training_log(str(tmp_path / "nothing.log"))


def test_dev_bleu_and_grad_norm_figures(logs, log_paths, tmp_path):
    bleu = figures.plot_dev_bleu(logs, str(tmp_path / "bleu.png"))
    assert list(bleu) == ["ScaleNorm", "DyT"]  # the run without --eval-bleu is left out
    valid = raw_records(log_paths["DyT"], "valid")
    assert bleu["DyT"] == ([5.0, 10.0, 15.0], [float(r["valid_bleu"]) for r in valid])
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
    with pytest.raises(NormplugError, match="unknown norm name 'dec2-mlp'"):
        figures.norm_sort_key("dec2-mlp")


def test_norm_names_of_every_registered_slot_sort_in_forward_order():
    """Every placement's and modifier's slots are norm names (``enc0.attn_out``, ``dec1.cross_q``),
    ordered sublayer by sublayer; a slot of a design not loaded here sorts after the known ones."""
    names = ["dec.final", "dec0.ffn_out", "dec0.cross_q", "enc0.mine", "enc0.ffn_inner", "enc0.attn_out",
             "enc.final", "enc1.attn", "enc0.resi_final", "enc0.attn", "dec0.attn_inner", "dec0.cross"]
    assert sorted(names, key=figures.norm_sort_key) == [
        "enc0.attn", "enc0.attn_out", "enc0.ffn_inner", "enc0.resi_final", "enc0.mine", "enc1.attn", "enc.final",
        "dec0.attn_inner", "dec0.cross", "dec0.cross_q", "dec0.ffn_out", "dec.final"]


# ---- seeds: a band (mean, min-max) per label, from hand-made logs -----------------------------

def write_log(path, valid_bleu=(), gnorm=(), g=None, label_smoothing=None):
    """A fairseq JSON training log: valid records {update: BLEU}, train_inner records
    {update: gnorm}, the last one also holding ScaleNorm g:<norm> values."""
    lines = []
    if label_smoothing is not None:
        lines.append("2025-01-01 00:00:00 | INFO | fairseq_cli.train | {'_name': None, 'criterion': {'_name': "
                     f"'label_smoothed_cross_entropy', 'label_smoothing': {label_smoothing}}}}}")
    gnorm = dict(gnorm)
    for index, (update, value) in enumerate(gnorm.items()):
        record = {"loss": "5.0", "gnorm": str(value), "num_updates": str(update)}
        if g and index == len(gnorm) - 1:
            record.update({f"g:{name}": str(v) for name, v in g.items()})
        lines.append(f"2025-01-01 00:00:01 | INFO | train_inner | {json.dumps(record)}")
    for update, value in dict(valid_bleu).items():
        record = {"valid_loss": "4.0", "valid_bleu": str(value), "valid_num_updates": str(update)}
        lines.append(f"2025-01-01 00:00:02 | INFO | valid | {json.dumps(record)}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib Figures the plot functions save, in order."""
    figs = []
    save = figures.save_figure
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: (figs.append(fig), save(fig, path)))
    return figs


def band_polygons(ax):
    """(x range, y range) of each shaded band (fill_between) on ``ax``."""
    out = []
    for collection in ax.collections:
        vertices = collection.get_paths()[0].vertices
        out.append(((vertices[:, 0].min(), vertices[:, 0].max()), (vertices[:, 1].min(), vertices[:, 1].max())))
    return out


def test_seed_band_in_the_dev_bleu_figure(tmp_path, drawn):
    seeds = [write_log(tmp_path / "a1.log", {10: 1.0, 20: 3.0, 30: 5.0}),
             write_log(tmp_path / "a2.log", {10: 3.0, 20: 5.0}),
             write_log(tmp_path / "a3.log", {10: 2.0, 20: 7.0, 30: 4.0})]
    single = write_log(tmp_path / "b.log", {10: 2.0, 20: 2.5})
    logs = figures.load_logs({"A": seeds, "B": single})
    data = figures.plot_dev_bleu(logs, str(tmp_path / "bleu.png"))
    assert data["A"] == figures.SeedBand(xs=[10.0, 20.0, 30.0], mean=[2.0, 5.0, 4.5], low=[1.0, 3.0, 4.0],
                                         high=[3.0, 7.0, 5.0], seeds=[3, 3, 2])
    assert data["B"] == ([10.0, 20.0], [2.0, 2.5])  # one seed: the line of today
    assert_png(tmp_path / "bleu.png")

    ax = drawn[-1].axes[0]
    mean_line, single_line = ax.lines
    assert list(mean_line.get_xdata()) == [10.0, 20.0, 30.0] and list(mean_line.get_ydata()) == [2.0, 5.0, 4.5]
    assert list(single_line.get_ydata()) == [2.0, 2.5]
    assert band_polygons(ax) == [((10.0, 30.0), (1.0, 7.0))]  # one band, A's min-max; none for B
    assert ax.collections[0].get_facecolor()[0][:3] == pytest.approx(to_rgb(mean_line.get_color()))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["A (mean, min-max of 3 seeds)", "B"]

    # no seed groups: exactly one line per log, no band
    figures.plot_dev_bleu(figures.load_logs({"A": seeds[0], "B": single}), str(tmp_path / "one.png"))
    assert len(drawn[-1].axes[0].lines) == 2 and band_polygons(drawn[-1].axes[0]) == []


def test_seed_band_in_the_grad_norm_and_scalenorm_g_figures(tmp_path, drawn):
    g1 = {"enc0.attn": 20.0, "enc1.attn": 21.0, "enc.final": 25.0, "dec.final": 30.0}
    g2 = {"enc0.attn": 22.0, "enc1.attn": 20.0, "enc.final": 27.0, "dec.final": 29.0}
    paths = [write_log(tmp_path / "s1.log", gnorm={5: 2.0, 10: 1.0}, g=g1),
             write_log(tmp_path / "s2.log", gnorm={5: 4.0, 10: 0.5}, g=g2)]
    logs = figures.load_logs({"ScaleNorm": paths})
    gnorm = figures.plot_grad_norm(logs, str(tmp_path / "gnorm.png"))
    assert gnorm["ScaleNorm"] == figures.SeedBand([5.0, 10.0], [3.0, 0.75], [2.0, 0.5], [4.0, 1.0], [2, 2])
    assert drawn[-1].axes[0].get_yscale() == "log"
    assert band_polygons(drawn[-1].axes[0]) == [((5.0, 10.0), (0.5, 4.0))]

    panels = figures.plot_scalenorm_g(logs, str(tmp_path / "g.png"))["ScaleNorm"]
    assert panels["enc.attn"] == figures.SeedBand([0, 1], [21.0, 20.5], [20.0, 20.0], [22.0, 21.0], [2, 2])
    assert panels["final"] == figures.SeedBand(["enc", "dec"], [26.0, 29.5], [25.0, 29.0], [27.0, 30.0], [2, 2])
    attention, final = drawn[-1].axes[0], drawn[-1].axes[5]
    assert list(attention.lines[0].get_ydata()) == [21.0, 20.5]
    assert band_polygons(attention) == [((0.0, 1.0), (20.0, 22.0))]
    assert band_polygons(final) == [((0.0, 1.0), (25.0, 30.0))]
    assert_png(tmp_path / "g.png")


def test_command_line_takes_the_seeds_of_a_label(tmp_path):
    first = write_log(tmp_path / "1.log", {10: 1.0}, {10: 1.0})
    second = write_log(tmp_path / "2.log", {10: 3.0}, {10: 2.0})
    assert figures.parse_log_specs([f"A={first}", f"A={second}", f"B={first}"]) == {"A": [first, second], "B": first}
    with pytest.raises(NormplugError, match="--log A=.*1.log given twice"):
        figures.parse_log_specs([f"A={first}", f"A={first}"])
    outcome = figures.main(["--log", f"A={first}", "--log", f"A={second}", "--out", str(tmp_path / "out"),
                            "--figures", "dev_bleu"])
    assert_png(outcome["dev_bleu"])


def png_size(path) -> tuple:
    """(width, height) in pixels of the PNG at ``path``."""
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    return width, height


def test_a_laid_out_figure_is_saved_at_its_size_and_one_without_a_layout_is_cropped(tmp_path):
    """save_figure: constrained layout keeps a legend beside the axes inside the canvas, so the
    PNG is figsize x 110 dpi; a figure without a layout engine is cropped to what it draws."""
    for layout in ("constrained", None):
        fig = figures.new_figure(figsize=(7, 4.5), layout=layout)
        ax = fig.add_subplot()
        ax.plot([1, 2, 3], [3, 1, 2], label="a design with a long name")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
        figures.save_figure(fig, str(tmp_path / f"{layout}.png"))
    assert png_size(tmp_path / "constrained.png") == (770, 495)
    assert png_size(tmp_path / "None.png") != (770, 495)
