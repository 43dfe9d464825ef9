"""convert_norms and plot_norms on a tiny stock-transformer LayerNorm model trained here:
the converted checkpoint loads (fairseq-generate too) and holds only calibrated DyT, the
calibrated alpha fits the real activations better than alpha = 0.5, the figures plot what the
CSV files say, and bad input fails in one line."""
import csv
import json
import math
import os
import re
import shutil

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.modules import MultiheadAttention

from conftest import REPO, cli, run_cli
from inprocess import forked_commands, run_fairseq
from test_cli import NO_LOADER_WORKERS
from fairseq_normplug.diagnostics import convert, fitting, plot_norms
from fairseq_normplug.diagnostics.attention import attention_logits, query_statistics
from fairseq_normplug.diagnostics.loading import batches, collect_norm_activations, dev_loss, load_checkpoint
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.models.norm_placement import named_norms
from fairseq_normplug.modules.derf import Derf
from fairseq_normplug.modules.dynamic_tanh import DynamicTanh

TINY_STOCK = ["--arch", "transformer", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
              "--encoder-attention-heads", "2", "--encoder-layers", "2", "--decoder-embed-dim", "64",
              "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "2", "--decoder-layers", "2",
              "--share-all-embeddings"]
SITES = ["enc0.attn", "enc0.ffn", "enc1.attn", "enc1.ffn", "dec0.attn", "dec0.cross", "dec0.ffn",
         "dec1.attn", "dec1.cross", "dec1.ffn"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def fine_tunes_forked():
    """The conversion's fine-tunes (``python -m fairseq_normplug.diagnostics.finetune``) run in
    forked children of this process (tests/inprocess.py's forked_commands): the conversion, not
    the start of a process, is the subject here (test_bad_input_one_line_each runs the script)."""
    with forked_commands():
        yield


@pytest.fixture(scope="module")
def trained(tiny_bin, tmp_path_factory):
    """A stock PostNorm LayerNorm transformer (d=64, 2+2 layers) trained 60 updates."""
    save_dir = tmp_path_factory.mktemp("trained")
    run_fairseq([cli("fairseq-train"), tiny_bin, *TINY_STOCK, "--cpu", "--num-workers", "0", "--optimizer", "adam",
                 "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
                 "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "1000",
                 "--max-update", "60", "--disable-validation", "--required-batch-size-multiple", "1",
                 "--no-epoch-checkpoints", "--save-dir", str(save_dir), "--seed", "1"])
    return str(save_dir / "checkpoint_last.pt")


@pytest.fixture(scope="module")
def converted(trained, tiny_bin, tmp_path_factory):
    """``trained`` converted to calibrated DyT on 2,000 calibration tokens (one batch; the fits'
    searches take time in proportion to the rows: the default 20,000 took ~4 s more), then
    fine-tuned 2 updates."""
    out = str(tmp_path_factory.mktemp("converted") / "dyt.pt")
    report = convert.convert(trained, tiny_bin, out, "dyt", finetune_updates=2, generation={"beam": 1},
                             echo=lambda message: None, calibration_tokens=2000)
    return out, report


@pytest.mark.slow
def test_conversion_gives_a_loadable_dyt_checkpoint(converted, tiny_bin):
    out, report = converted
    [model], cfg, _ = checkpoint_utils.load_model_ensemble_and_task([out], arg_overrides={"data": tiny_bin})
    assert cfg.model.arch == "transformer_normplug" and cfg.model.norm_type == "dyt"
    norms = named_norms(model)
    assert list(norms) == SITES
    assert all(type(norm) is DynamicTanh for norm in norms.values())
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    for name, norm in norms.items():
        assert float(norm.alpha) == pytest.approx(report["fits"][name]["alpha"], rel=1e-6)
    stages = [stage["stage"] for stage in report["stages"]]
    assert stages == ["before conversion (LayerNorm)", "naive swap (dyt, alpha = 0.5)",
                      "calibrated dyt (no training)", "calibrated dyt + 2-update fine-tune"]
    assert all(0 <= stage["bleu"] <= 100 and stage["loss"] > 0 for stage in report["stages"])
    # calibration beats the naive swap on dev loss
    assert report["calibration_beats_naive"] and report["stages"][2]["loss"] < report["stages"][1]["loss"]
    json_path, md_path, finetune_dir = convert.report_paths(out)
    assert '"calibration_beats_naive": true' in open(json_path).read()
    markdown = open(md_path).read()
    assert "| calibrated dyt (no training) | " in markdown and "| dec1.cross |" in markdown
    assert report["finetuned"] == os.path.join(finetune_dir, "checkpoint_last.pt")

    proc = run_fairseq([cli("fairseq-generate"), tiny_bin, "--path", out, "--user-dir",
                        os.path.join(REPO, "fairseq_normplug"), "--beam", "1", "--cpu", "--gen-subset", "valid",
                        "--max-tokens", "4000", "--required-batch-size-multiple", "1", *NO_LOADER_WORKERS])
    assert sum(line.startswith("H-") for line in proc.stdout.splitlines()) == 100


@pytest.mark.slow
def test_calibrated_alpha_fits_better_than_the_default(trained, tiny_bin, converted):
    loaded = load_checkpoint(trained, tiny_bin)
    samples = list(batches(loaded.task, "valid", 1000, limit_tokens=500))  # held out from calibration
    calibrated = named_norms(load_checkpoint(converted[0], tiny_bin).model)
    for name, (layer_norm, x, y) in collect_norm_activations(loaded, samples).items():
        assert torch.allclose(layer_norm(x), y, atol=1e-5)  # the recorded pairs are the LayerNorm's
        naive = fitting.mean_squared_error(fitting.naive_dyt(layer_norm)(x), y)
        with torch.no_grad():
            assert fitting.mean_squared_error(calibrated[name](x), y) < 0.8 * naive, name
        # alpha alone (gamma kept) already beats alpha = 0.5
        module, info = fitting.fit_dyt(layer_norm, x, y, refit_gamma=False)
        assert torch.equal(module.weight, layer_norm.weight) and info["mse"] < info["naive_mse"]
        assert info["mse"] == pytest.approx(fitting.mean_squared_error(module(x).detach(), y), rel=1e-4)
        derf, info = fitting.fit_derf(layer_norm, x, y)
        assert info["mse"] < info["naive_mse"] and -1 <= float(derf.shift) <= 1
        with torch.no_grad():
            assert fitting.mean_squared_error(derf(x), y) < fitting.mean_squared_error(fitting.naive_derf(layer_norm)(x), y)


@pytest.mark.slow
def test_conversion_to_derf(trained, tiny_bin, tmp_path):
    out = str(tmp_path / "derf.pt")
    # 2,000 calibration tokens: Derf's alternating shift and alpha searches take time in proportion
    # to the rows (up to fitting.SEARCH_ROWS): 4,000 took about twice as long, the default 20,000 ~20 s more
    report = convert.convert(trained, tiny_bin, out, "derf", generation={"beam": 1}, echo=lambda message: None,
                             calibration_tokens=2000)
    assert report["calibration_beats_naive"] and [s["stage"] for s in report["stages"]][1:] == [
        "naive swap (derf, alpha = 0.5)", "calibrated derf (no training)"]
    norms = named_norms(load_checkpoint(out, tiny_bin).model)
    assert list(norms) == SITES and all(type(norm) is Derf for norm in norms.values())
    assert float(norms["dec0.ffn"].shift) == pytest.approx(report["fits"]["dec0.ffn"]["shift"], abs=1e-6)


def test_minimise_log_scalar_finds_the_minimum():
    alpha, value = fitting.minimise_log_scalar(lambda a: (a - 0.37) ** 2, center=1.0)
    assert alpha == pytest.approx(0.37, rel=1e-4) and value < 1e-8


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC and os.path.getsize(path) > 5000


def recomputed_norm_inputs(checkpoint, data, tokens):
    """{site: (norm, inputs, outputs)} recomputed here, with this test's own hooks, on the
    batches plot_norms reads (the same selection: diagnostics.loading.batches, its seed and
    token limit): (rows, C) float32 matrices of the real (non-padding) positions."""
    loaded = load_checkpoint(checkpoint, data)
    samples = list(batches(loaded.task, "valid", plot_norms.BATCH_TOKENS, limit_tokens=tokens))
    norms = named_norms(loaded.model)
    seen = {name: ([], []) for name in norms}

    def recorder(name):
        def record(module, inputs, output):  # returns None: the output is left as it is
            seen[name][0].append(inputs[0].detach())
            seen[name][1].append(output.detach())
        return record

    handles = [norm.register_forward_hook(recorder(name)) for name, norm in norms.items()]
    pad = loaded.task.source_dictionary.pad()
    masks = []
    with torch.no_grad():
        for sample in samples:
            net = sample["net_input"]
            loaded.model(**net)
            masks.append({"enc": net["src_tokens"].ne(pad).t(), "dec": net["prev_output_tokens"].ne(pad).t()})
    for handle in handles:
        handle.remove()
    out = {}
    for name, (xs, ys) in seen.items():
        keep = [m[name[:3]] for m in masks]  # (time, batch), as the norms see their input
        out[name] = (norms[name], torch.cat([x.float()[k] for x, k in zip(xs, keep)]),
                     torch.cat([y.float()[k] for y, k in zip(ys, keep)]))
    return out


@pytest.fixture
def drawn_figures(monkeypatch):
    """{PNG name: the matplotlib Figure plot_norms saved}, recorded as it is saved."""
    saved = {}
    save = plot_norms.save_figure

    def recording_save(fig, path):
        saved[os.path.basename(path)] = fig
        save(fig, path)

    monkeypatch.setattr(plot_norms, "save_figure", recording_save)
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("which", ["layernorm", "dyt"])
def test_plots_show_the_norms_inputs_outputs_and_scales(which, trained, converted, tiny_bin, tmp_path,
                                                        drawn_figures):
    """What the figures draw and the CSV says, checked against activations recomputed by this
    test: each S-curve point is a real (input, output) pair of its site; the scale panel draws
    each site's scale (LayerNorm: mean 1/std per token; DyT: alpha) and 1/std of its input;
    the DyT saturation bars are the share of |alpha x| > 2."""
    checkpoint = trained if which == "layernorm" else converted[0]
    plot_norms.main([checkpoint, tiny_bin, str(tmp_path), "--tokens", "400", "--points", "500"])
    names = sorted(os.listdir(tmp_path))
    assert names == ["attention.csv", "attention.png", "norms.csv", "s_curves_dec.png", "s_curves_enc.png",
                     "scale_vs_std.png"]
    for name in names:
        if name.endswith(".png"):
            assert_png(tmp_path / name)
    assert sorted(drawn_figures) == [n for n in names if n.endswith(".png")]
    recomputed = recomputed_norm_inputs(checkpoint, tiny_bin, 400)
    assert list(recomputed) == SITES
    expected = {}
    for site, (norm, x, y) in recomputed.items():
        if which == "dyt":
            assert type(norm) is DynamicTanh
            scale = float(norm.alpha)
        else:
            scale = float((x.var(dim=-1, unbiased=False) + norm.eps).rsqrt().mean())
        expected[site] = {"scale": scale, "inverse_std": 1 / float(x.std()), "tokens": x.shape[0],
                          "saturated": float((scale * x).abs().gt(2).float().mean())}

    norms = read_csv(tmp_path / "norms.csv")
    assert [row["site"] for row in norms] == SITES and {row["norm_type"] for row in norms} == {which}
    for row in norms:
        assert float(row["scale"]) == pytest.approx(expected[row["site"]]["scale"], rel=1e-5)
        assert float(row["inverse_std"]) == pytest.approx(expected[row["site"]]["inverse_std"], rel=1e-5)
        assert int(row["tokens"]) == expected[row["site"]]["tokens"]
    assert {row["scale_kind"] for row in norms} == {"alpha" if which == "dyt" else "mean 1/std per token"}

    scale_axes = drawn_figures["scale_vs_std.png"].axes
    scale_line, inverse_std_line = scale_axes[0].lines[:2]
    assert list(scale_line.get_ydata()) == pytest.approx([expected[s]["scale"] for s in SITES], rel=1e-5)
    assert list(inverse_std_line.get_ydata()) == pytest.approx([expected[s]["inverse_std"] for s in SITES],
                                                               rel=1e-5)
    assert [label.get_text() for label in scale_axes[0].get_xticklabels()] == SITES
    if which == "dyt":
        bars = [patch.get_height() for patch in scale_axes[1].patches]
        assert bars == pytest.approx([expected[s]["saturated"] for s in SITES], abs=1e-6)
        assert all(row["saturated_fraction"] != "" for row in norms)
    else:
        assert len(scale_axes) == 1 and all(row["saturated_fraction"] == "" for row in norms)

    for png, sites in (("s_curves_enc.png", SITES[:4]), ("s_curves_dec.png", SITES[4:])):
        panels = [ax for ax in drawn_figures[png].axes if ax.get_visible()]
        assert [ax.get_title().split(" ")[0] for ax in panels] == sites
        for ax, site in zip(panels, sites):
            _, x, y = recomputed[site]
            pairs = set(zip(x.flatten().tolist(), y.flatten().tolist()))
            points = ax.collections[0].get_offsets()
            assert len(points) == 500 and all((float(px), float(py)) in pairs for px, py in points), site

    attention = read_csv(tmp_path / "attention.csv")
    assert [row["attention"] for row in attention] == ["enc0.self", "enc1.self", "dec0.self", "dec0.cross",
                                                       "dec1.self", "dec1.cross"]
    left, right = drawn_figures["attention.png"].axes
    for ax, column in ((left, "max_logit"), (right, "entropy")):  # one line per attention kind
        for line in ax.lines:
            stack, kind = line.get_label().split(".")
            rows = [row for row in attention if row["stack"] == stack and row["kind"] == kind]
            assert list(line.get_xdata()) == [int(row["layer"]) for row in rows]
            assert list(line.get_ydata()) == pytest.approx([float(row[column]) for row in rows])
    for row in attention:  # entropy of a distribution over the keys, below log(most keys)
        assert 0 < float(row["entropy"]) < math.log(1024) and math.isfinite(float(row["max_logit"]))
    assert {line.get_label() for line in right.lines} == {"enc.self", "dec.self", "dec.cross"}


def test_recomputed_attention_matches_fairseq():
    torch.manual_seed(0)
    attention = MultiheadAttention(16, 4, self_attention=True).eval()
    x = torch.randn(5, 3, 16)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    causal = torch.triu(torch.full((5, 5), float("-inf")), 1)
    _, weights = attention(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=True)
    logits = attention_logits(attention, x, x, padding, causal)  # (batch, heads, queries, keys)
    assert torch.allclose(torch.softmax(logits, -1).mean(1), weights, atol=1e-6)  # fairseq: mean over heads
    stats = query_statistics(logits)
    assert torch.allclose(stats["entropy"][:, 0], torch.zeros(3), atol=1e-6)  # the first query sees one key
    assert torch.all(stats["entropy"][:, 1:] > 0)
    assert torch.allclose(stats["max_logit"][:, 0], logits[:, :, 0, 0].amax(1))
    assert stats["max_logit"].shape == (3, 5)


@pytest.mark.slow
def test_bad_input_one_line_each(trained, converted, tiny_bin, tmp_path):
    mismatched = tmp_path / "other_dict"
    shutil.copytree(tiny_bin, mismatched)
    for side in ("src", "tgt"):
        with open(mismatched / f"dict.{side}.txt", "a") as f:
            f.write("extra1 1\nextra2 1\n")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    out = str(tmp_path / "out.pt")
    cases = [
        ([str(tmp_path / "missing.pt"), tiny_bin, out], "no such checkpoint: .*missing.pt"),
        ([str(garbage), tiny_bin, out], "cannot read .*garbage.pt as a fairseq checkpoint"),
        ([converted[0], tiny_bin, out], "has no LayerNorm to convert \\(its norms: DynamicTanh\\)"),
        ([trained, str(mismatched), out], "other_dict does not match .*: its source dictionary has"),
        ([trained, str(tmp_path), out], "is not a binarized data folder"),
        ([trained, tiny_bin, out, "--to", "erf"], "unknown conversion target --to 'erf'; choose from dyt, derf, folded, none$"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            convert.main(argv)
        text = str(exit_info.value)
        assert text.startswith("convert_norms.sh: error: ") and "\n" not in text
        assert re.search(message, text), text
    assert not os.path.exists(out)
    with pytest.raises(SystemExit, match="plot_norms.sh: error: .*does not match"):
        plot_norms.main([trained, str(mismatched), str(tmp_path / "plots")])
    proc = run_cli([os.path.join(REPO, "scripts", "convert_norms.sh"), str(tmp_path / "missing.pt"), tiny_bin,
                    out], check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"convert_norms.sh: error: no such checkpoint: {tmp_path}/missing.pt"]


@pytest.mark.slow
def test_load_checkpoint_rejects_a_missing_subset(trained, tiny_bin, tmp_path):
    with pytest.raises(NormplugError, match="has no 'nothing' subset"):
        plot_norms.plot_norms(trained, tiny_bin, str(tmp_path), subset="nothing")


# ---- joint gamma/beta fit, layer-by-layer calibration ---------------------------------------------

def test_closed_form_affine_equals_least_squares_per_channel():
    torch.manual_seed(0)
    t = torch.tanh(torch.randn(300, 6) * 2)
    y = 1.7 * t - 0.3 + 0.2 * torch.randn(300, 6)
    t[:, 5] = 0.25  # a degenerate channel: its regressor has no variance
    gamma, beta = fitting.closed_form_affine(t, y, fallback_gamma=torch.full((6,), 0.9))
    assert torch.isfinite(gamma).all() and torch.isfinite(beta).all()
    for c in range(5):
        design = torch.stack([t[:, c], torch.ones(300)], 1).double()
        solution = torch.linalg.lstsq(design, y[:, c:c + 1].double()).solution.flatten()
        assert float(gamma[c]) == pytest.approx(float(solution[0]), abs=1e-5)
        assert float(beta[c]) == pytest.approx(float(solution[1]), abs=1e-5)
    # the degenerate channel keeps the fallback gamma and gets the best beta for it: mean(y)
    assert float(gamma[5]) == pytest.approx(0.9) and float(beta[5]) == pytest.approx(float(y[:, 5].mean() - 0.225), abs=1e-5)
    residual = ((gamma * t + beta - y) ** 2).mean()
    assert fitting.profiled_error(t, y) == pytest.approx(float(residual), rel=1e-5)


@pytest.mark.parametrize("kind", ["dyt", "derf"])
def test_joint_fit_recovers_known_parameters(kind):
    torch.manual_seed(1)
    x = torch.randn(4000, 16) * 3 + 0.5
    gamma, beta = torch.rand(16) + 0.5, torch.randn(16) * 0.3
    if kind == "dyt":
        true = DynamicTanh(16, alpha_init=0.37)
    else:
        true = Derf(16, alpha_init=0.37, shift_init=0.2)
    with torch.no_grad():
        true.weight.copy_(gamma)
        true.bias.copy_(beta)
        y = true(x)
    layer_norm = torch.nn.LayerNorm(16)  # its own gamma=1, beta=0: not the answer
    module, info = fitting.target(kind).fit(layer_norm, x, y)
    assert info["affine"] == "joint" and info["mse"] < 1e-8
    assert float(module.alpha) == pytest.approx(0.37, rel=1e-3)
    assert torch.allclose(module.weight, gamma, atol=1e-3) and torch.allclose(module.bias, beta, atol=1e-3)
    if kind == "derf":
        assert float(module.shift) == pytest.approx(0.2, abs=1e-3)


@pytest.fixture(scope="module")
def calibration_samples(trained, tiny_bin):
    loaded = load_checkpoint(trained, tiny_bin)
    return loaded, list(batches(loaded.task, "train", convert.CALIBRATION_BATCH_TOKENS, limit_tokens=6000))


@pytest.mark.slow
def test_joint_fit_error_not_above_the_earlier_fits(calibration_samples):
    loaded, samples = calibration_samples
    for name, (layer_norm, x, y) in collect_norm_activations(loaded, samples[:1]).items():
        x, y = x[:1500], y[:1500]
        joint, joint_info = fitting.fit_dyt(layer_norm, x, y)
        _, gamma_info = fitting.fit_dyt(layer_norm, x, y, affine="gamma")
        _, keep_info = fitting.fit_dyt(layer_norm, x, y, affine="keep")
        assert joint_info["mse"] <= gamma_info["mse"] * (1 + 1e-4) + 1e-9, name
        assert gamma_info["mse"] <= keep_info["mse"] * (1 + 1e-4) + 1e-9, name
        with torch.no_grad():
            assert joint_info["mse"] == pytest.approx(fitting.mean_squared_error(joint(x), y), rel=1e-4)
        _, derf_joint = fitting.fit_derf(layer_norm, x, y)
        _, derf_gamma = fitting.fit_derf(layer_norm, x, y, affine="gamma")
        assert derf_joint["mse"] <= derf_gamma["mse"] * (1 + 1e-4) + 1e-9, name


@pytest.mark.slow
def test_layerwise_calibration_fits_each_norm_on_the_converted_models_inputs(calibration_samples):
    loaded, samples = calibration_samples
    inputs = {}
    model, fits = convert.calibrate(loaded, samples, fitting.target("dyt"), "layerwise", "joint", inputs=inputs)
    assert list(fits) == SITES and list(inputs) == SITES
    assert all(type(norm) is DynamicTanh for norm in named_norms(model).values())
    assert all(fitting.is_layer_norm(norm) for norm in named_norms(loaded.model).values())  # left unchanged
    seen = {name: [] for name in SITES}
    handles = [norm.register_forward_hook(lambda m, i, o, name=name: seen[name].append(i[0].detach()))
               for name, norm in named_norms(model).items()]
    pad = loaded.task.source_dictionary.pad()
    with torch.no_grad():
        for sample in samples:
            model(**sample["net_input"])
    for handle in handles:
        handle.remove()
    for name, (_, x_original, _) in collect_norm_activations(loaded, samples).items():
        masks = [{"enc": s["net_input"]["src_tokens"].ne(pad).t(), "dec": s["net_input"]["prev_output_tokens"].ne(pad).t()}
                 for s in samples]
        rows = torch.cat([x.float()[m[name[:3]]] for x, m in zip(seen[name], masks)])
        # the input norm k was fitted on is its input in the converted model (norms < k converted)
        assert torch.allclose(inputs[name], rows, atol=1e-5), name
        if name in ("enc0.attn", "dec0.attn"):  # no converted norm before them on their path
            assert torch.allclose(inputs[name], x_original, atol=1e-6), name
        else:  # ... the others' inputs differ from the original model's
            assert not torch.allclose(inputs[name], x_original, atol=1e-4), name


@pytest.mark.slow
def test_layerwise_joint_calibration_is_no_worse_than_the_earlier_method(calibration_samples, tiny_bin):
    """Dev loss of the new default (layerwise, joint gamma/beta, the larger sample) against the
    earlier method (per-norm, gamma refitted, 2000 tokens in 1000-token batches)."""
    loaded, samples = calibration_samples
    task = loaded.task
    criterion = task.build_criterion(loaded.cfg.criterion)
    target = fitting.target("dyt")
    earlier_samples = list(batches(task, "train", 1000, limit_tokens=2000))
    earlier, _ = convert.calibrate(loaded, earlier_samples, target, "per-norm", "gamma")
    new, _ = convert.calibrate(loaded, samples, target)
    earlier_loss = dev_loss(earlier, task, criterion)["loss"]
    new_loss = dev_loss(new, task, criterion)["loss"]
    assert new_loss <= earlier_loss, (new_loss, earlier_loss)


@pytest.mark.slow
def test_calibration_that_does_not_beat_the_naive_swap_exits_3(trained, tiny_bin, tmp_path, monkeypatch):
    def naive_fit(layer_norm, x, y, affine="joint"):
        module = fitting.naive_dyt(layer_norm)
        return module, {"alpha": 0.5, "mse": 1.0, "naive_mse": 1.0, "in_std": 1.0, "out_var": 1.0,
                        "gamma_refitted": False}

    monkeypatch.setitem(fitting.TARGETS, "dyt", fitting.Target("dyt", fitting.naive_dyt, naive_fit))
    monkeypatch.setattr(convert, "evaluate_model", lambda model, *a, **k: {
        **dev_loss(model, a[0], a[1]), "bleu": 0.0})
    out = str(tmp_path / "naive.pt")
    with pytest.raises(SystemExit) as exit_info:
        convert.main([trained, tiny_bin, out, "--calibration-tokens", "500"])
    assert exit_info.value.code == convert.NOT_BETTER_EXIT_CODE
    report = json.load(open(convert.report_paths(out)[0]))
    assert [s["stage"] for s in report["stages"]] == ["before conversion (LayerNorm)", "naive swap (dyt, alpha = 0.5)",
                                                     "calibrated dyt (no training)"]
    assert not report["calibration_beats_naive"] and report["calibration"] == "layerwise"


@pytest.mark.slow
def test_bad_calibration_choices_one_line(trained, tiny_bin, tmp_path):
    out = str(tmp_path / "out.pt")
    for argv, message in (([trained, tiny_bin, out, "--calibration", "greedy"],
                           "unknown --calibration 'greedy'; choose from layerwise, per-norm"),
                          ([trained, tiny_bin, out, "--affine", "both"],
                           "unknown --affine 'both'; choose from joint, gamma, keep"),
                          ([trained, tiny_bin, out, "--affine", "joint", "--keep-gamma"],
                           "--keep-gamma contradicts --affine joint")):
        with pytest.raises(SystemExit) as exit_info:
            convert.main(argv)
        text = str(exit_info.value)
        assert text.startswith("convert_norms.sh: error: ") and message in text and "\n" not in text, text
    assert not os.path.exists(out)


@pytest.mark.slow
def test_removal_by_fine_tuning_keeps_postnorm_norms_as_fixed_affine_maps(trained, tiny_bin, tmp_path):
    """--to none (remove_norms.py) on the trained PostNorm fixture: one norm removed per update
    from update 1 (FFN norms first), 6 more updates after the last; nothing is folded."""
    out = str(tmp_path / "none.pt")
    report = convert.main([trained, tiny_bin, out, "--to", "none", "--removal-every", "1", "--removal-start", "1",
                           "--calibration-tokens", "2000", "--beam", "1", "--control"])
    before, naive, finetuned, control = report["stages"]
    assert [stage["stage"] for stage in report["stages"]] == [
        "before removal (LayerNorm)", "naive removal (std -> its average c, no fine-tune)",
        "fine-tuned removal (16 updates)", "LayerNorm + the same 16-update fine-tune (control)"]
    assert naive["loss"] > before["loss"] and finetuned["loss"] < naive["loss"]
    # --control: the LayerNorm model itself, fine-tuned alike (the removal paper's comparison)
    controlled = torch.load(convert.report_paths(out)[2] + ".control/checkpoint_last.pt", weights_only=False)
    assert getattr(controlled["cfg"]["model"], "norm_type", "layernorm") == "layernorm" and report["control"]
    assert controlled["optimizer_history"][-1]["num_updates"] == 16
    assert math.isfinite(control["loss"]) and control["loss"] != before["loss"]
    assert all(math.isfinite(stage["bleu"]) for stage in report["stages"])
    ffn = [site for site in SITES if site.endswith(".ffn")]
    assert list(report["schedule"]) == ffn + [site for site in SITES if site not in ffn]
    assert list(report["schedule"].values()) == list(range(1, 11)) and report["finetune"]["updates"] == 16
    assert not report["folded"] and report["folded_sites"] == []
    assert report["not_folded_reason"] == "not PreNorm: each norm's output is the residual stream"
    [model], cfg, _ = checkpoint_utils.load_model_ensemble_and_task([out], arg_overrides={"data": tiny_bin})
    assert cfg.model.norm_type == "layernorm-fixed-std" and not cfg.model.fixed_std_folded
    norms = named_norms(model)
    assert sorted(norms) == sorted(SITES)
    for site, norm in norms.items():
        assert norm.uses_fixed_std and float(norm.fixed_std) == pytest.approx(report["stds"][site], rel=1e-6)
    json_path, md_path, finetune_dir = convert.report_paths(out)
    assert json.load(open(json_path))["stages"] == report["stages"]
    assert "| enc0.ffn |" in open(md_path).read() and os.path.isfile(os.path.join(finetune_dir, "train.log"))
    start = torch.load(f"{finetune_dir}.start.pt", weights_only=False)
    assert int(start["model"]["encoder.layers.0.final_layer_norm.removal_update"]) == 1
    assert not bool(start["model"]["encoder.layers.0.final_layer_norm.removed"])
    assert start["optimizer_history"][-1]["num_updates"] == 0  # else the trainer's load switches them all


@pytest.mark.slow
def test_removal_refusals_one_line(trained, converted, tiny_bin, tmp_path):
    out = str(tmp_path / "out.pt")
    cases = [
        ([converted[0], tiny_bin, out, "--to", "none"], "has no LayerNorm to convert"),
        ([trained, tiny_bin, out, "--to", "none", "--affine", "joint"], "--affine applies to --to dyt|derf, not --to none"),
        ([trained, tiny_bin, out, "--removal-every", "2"], "--removal-every applies to --to none, not --to dyt"),
        ([trained, tiny_bin, out, "--to", "none", "--removal-every", "0"], "--removal-every and --removal-start must be >= 1"),
        ([trained, tiny_bin, out, "--to", "none", "--finetune-updates", "5", "--calibration-tokens", "500"],
         "--finetune-updates 5 ends before the last of the 10 norms is removed \\(after update 100\\)"),
        ([trained, tiny_bin, out, "--control"], "--control fine-tunes the LayerNorm model as the converted one is: "
                                                "it needs --finetune-updates N > 0 with --to dyt$"),
        ([trained, tiny_bin, out, "--to", "folded", "--control"], "--control applies to --to dyt\\|derf\\|none"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            convert.main(argv)
        text = str(exit_info.value)
        assert text.startswith("convert_norms.sh: error: ") and "\n" not in text and re.search(message, text), text
    assert not os.path.exists(out)


@pytest.mark.slow
def test_removal_folds_a_prenorm_model(tiny_bin, tmp_path):
    """--to none on a PreNorm model (5 updates: only the folding path is under test): OUT has
    identities at the folded sites, the decoder's final norm is the fixed affine map, and OUT
    gives the fine-tuned fixed-std model's dev loss."""
    save_dir = tmp_path / "prenorm"
    run_fairseq([cli("fairseq-train"), tiny_bin, *TINY_STOCK, "--encoder-normalize-before", "--decoder-normalize-before",
                 "--cpu", "--num-workers", "0", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1000",
                 "--max-update", "5", "--disable-validation", "--no-epoch-checkpoints", "--save-dir", str(save_dir),
                 "--seed", "1"])
    out = str(tmp_path / "folded.pt")
    report = convert.main([str(save_dir / "checkpoint_last.pt"), tiny_bin, out, "--to", "none",
                           "--removal-every", "1", "--removal-start", "1", "--calibration-tokens", "1000",
                           "--finetune-updates", "13", "--beam", "1"])
    assert report["folded"] and report["not_folded_reason"] is None
    assert report["stages"][-1]["stage"] == "fine-tuned removal (13 updates, folded)"
    assert set(report["folded_sites"]) == set(report["stds"]) - {"dec.final"}
    loaded = load_checkpoint(out, tiny_bin)
    assert loaded.cfg.model.fixed_std_folded and loaded.cfg.model.norm_type == "layernorm-fixed-std"
    kinds = {name: type(norm).__name__ for name, norm in named_norms(loaded.model).items()}
    assert kinds.pop("dec.final") == "FixedStdLayerNorm" and set(kinds.values()) == {"IdentityNorm"}
    unfolded = load_checkpoint(report["finetuned"], tiny_bin)
    criterion = unfolded.task.build_criterion(unfolded.cfg.criterion)
    assert dev_loss(loaded.model, loaded.task, criterion)["loss"] == pytest.approx(
        dev_loss(unfolded.model, unfolded.task, criterion)["loss"], abs=1e-4)


@pytest.mark.slow
def test_a_fine_tune_uses_this_plugin_whatever_checkout_trained_the_run(trained, tmp_path):
    """A checkpoint stores the --user-dir it was trained with; the fine-tune imports this plugin
    (another path would clash: fairseq needs the module name fairseq_normplug to be unique)."""
    from fairseq_normplug.cli import user_dir
    from fairseq_normplug.diagnostics.finetune import finetune_config

    state = torch.load(trained, weights_only=False)
    state["cfg"]["common"]["user_dir"] = "/another/checkout/fairseq_normplug"
    moved = str(tmp_path / "moved.pt")
    torch.save(state, moved)
    cfg = finetune_config(moved, str(tmp_path), str(tmp_path / "ft"), 3, 1e-4)
    assert cfg.common.user_dir == user_dir() != "/another/checkout/fairseq_normplug"
