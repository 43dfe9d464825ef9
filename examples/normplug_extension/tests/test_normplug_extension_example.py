"""The example extension's own tests, written as a researcher would in their own repository:
only the plugin's public interface, fairseq's command-line tools and a tiny corpus made here.

They check the formula against the authors' code, the norm under every registered placement
(finite, every parameter trained, incremental decoding = the full forward), and the whole path:
``fairseq-train --normplug-modules`` with the norm's own flag, the checkpoint recording the
extension, ``fairseq-generate`` and the hub decoding it without being told about the extension,
a moved extension named in one line, and an installed package's entry point. A command runs as a
process of its own where the process matters (the extension named only on its command line, in an
environment variable or by an entry point; the one-line error; fairseq-generate decoding it
unprompted), else in this process, as fairseq's own tests run its tools, with the extension taken
out of it first.
"""
import contextlib
import importlib
import io
import logging
import os
import subprocess
import sys

import pytest
import torch

import fairseq_normplug
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.extensions import load_extensions
from fairseq_normplug.modules.norm_registry import NORM_TYPES, build_norm, norm_args

HERE = os.path.dirname(os.path.abspath(__file__))
EXTENSION = os.path.join(os.path.dirname(HERE), "normplug_extension_example")
USER_DIR = os.path.dirname(os.path.abspath(fairseq_normplug.__file__))
BIN = os.path.dirname(sys.executable)
TIMEOUT = 600


def run(*args, check=True, env=None, cwd=None, input_text=None):
    environment = {**os.environ, **(env or {})}
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=TIMEOUT,
                          env=environment, cwd=cwd, input=input_text)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module", autouse=True)
def extension():
    """The extension loaded in this process, as ``--normplug-modules`` does in a command; taken
    out of the registries afterwards, so other test files in this process see the built-ins only."""
    from fairseq_normplug.extensions import LOADED
    from fairseq_normplug.models.placements import PLACEMENTS

    load_extensions(EXTENSION)
    yield NORM_TYPES["prmsnorm"]
    unload_extension()


def unload_extension():
    """The extension taken out of this process (its norm, its placement, its modules), as a new
    process starts without it."""
    from fairseq_normplug.extensions import LOADED
    from fairseq_normplug.models.placements import PLACEMENTS

    NORM_TYPES.pop("prmsnorm", None), PLACEMENTS.pop("parallel", None), LOADED.pop("normplug_extension_example", None)
    for name in [name for name in sys.modules if name.startswith("normplug_extension_example")]:
        del sys.modules[name]


def run_here(tool, *args, input_text=None, cwd=None):
    """fairseq's command-line tool ``tool`` (``generate``, ``interactive``, ``validate``) run in this
    process, as fairseq's own tests run theirs (``generate.main``), after the extension is taken
    out of it (:func:`unload_extension`): the checkpoint alone must bring it back. Returns what the
    command prints and logs (fairseq's log format) and reads ``input_text`` as its standard input.
    (The project's tests/inprocess.py has a fuller ``run_fairseq``; this example's tests stand alone, as a
    researcher's own package's would.)"""
    from fairseq.logging import metrics

    unload_extension()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s"))
    root = logging.getLogger()
    saved = root.handlers[:], root.level, sys.argv, sys.stdin, os.getcwd()
    root.handlers, sys.argv, sys.stdin = [handler], [f"fairseq-{tool}", *map(str, args)], io.StringIO(input_text or "")
    root.setLevel(logging.INFO)
    metrics.reset()  # as a new process has them
    try:
        os.chdir(cwd or os.getcwd())
        with contextlib.redirect_stdout(out):
            importlib.import_module(f"fairseq_cli.{tool}").cli_main()
    finally:
        (root.handlers, level, sys.argv, sys.stdin, cwd_before) = saved
        root.setLevel(level)
        os.chdir(cwd_before)
    return out.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny synthetic parallel corpus, binarized with a joined dictionary by fairseq-preprocess's
    main, in this process (as fairseq's own tests do: nothing of the extension is involved)."""
    from fairseq import options
    from fairseq_cli import preprocess

    from fairseq_normplug.synthetic_corpus import write_corpus

    raw = write_corpus(str(tmp_path_factory.mktemp("raw")), train=600, valid=40, test=40, vocab_size=40)
    dest = tmp_path_factory.mktemp("bin")
    handlers = preprocess.logger.handlers[:]  # main adds a log file handler that a process would close at exit
    try:
        preprocess.main(options.get_preprocessing_parser().parse_args([
            "--source-lang", "src", "--target-lang", "tgt", "--trainpref", f"{raw}/train", "--validpref",
            f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", str(dest), "--joined-dictionary", "--workers", "1"]))
    finally:
        for handler in preprocess.logger.handlers[len(handlers):]:
            handler.close()
        preprocess.logger.handlers = handlers
    return str(dest)


def authors_prms_norm(x, scale, p, eps=1e-8):
    """bzhangGo/rmsnorm ``rmsnorm_torch.py``, partial branch, written out."""
    d = x.size(-1)
    partial = int(d * p)
    rms = x[..., :partial].norm(2, dim=-1, keepdim=True) * partial ** -0.5
    return scale * x / (rms + eps)


def test_formula_and_gradients_match_the_authors_code(extension):
    norm = build_norm(norm_args("prmsnorm", prms_p=0.25), 16)
    assert norm.partial == 4 and type(norm).__name__ == "PartialRMSNorm"
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    scale = norm.weight.detach().clone().requires_grad_()
    out, expected = norm(x), authors_prms_norm(x_ref, scale, 0.25)
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(norm.weight.grad, scale.grad)
    # an all-zero row (fairseq's padding positions): finite output and gradients
    zeros = torch.zeros(2, 16, requires_grad=True)
    norm(zeros).sum().backward()
    assert torch.isfinite(zeros.grad).all() and torch.isfinite(norm.weight.grad).all()
    # bf16 input: computed in float32, returned in bf16
    low = norm(x.detach().bfloat16())
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), norm(x.detach().bfloat16().float()).detach(), rtol=1e-2, atol=1e-2)


def test_zero_centered_gamma_and_refusals(extension):
    zero_centered = build_norm(norm_args("prmsnorm", zero_centered_gamma=True), 32)
    assert zero_centered.zero_centered_gamma and torch.all(zero_centered.weight == 0)
    x = torch.randn(2, 32)
    torch.testing.assert_close(zero_centered(x), build_norm(norm_args("prmsnorm"), 32)(x))
    with pytest.raises(NormplugError, match=r"^--prms-p must be in \(0, 1\], got 1.5$"):
        norm_args("prmsnorm", prms_p=1.5)
    with pytest.raises(NormplugError, match=r"^--prms-p 0.01 keeps no channel of a 32-wide norm"):
        build_norm(norm_args("prmsnorm", prms_p=0.01), 32)
    with pytest.raises(NormplugError, match=r"^--prms-p needs --norm-type prmsnorm, got --norm-type layernorm$"):
        norm_args("layernorm", prms_p=0.5)


def build_model(corpus, *flags):
    """The model fairseq-train would build from ``flags`` (tiny preset), with a fixed seed."""
    from fairseq import options, tasks

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [corpus, "--user-dir", USER_DIR, "--task", "translation",
                                                "--arch", "transformer_normplug_tiny", "--cpu", *flags])
    task = tasks.setup_task(args)
    torch.manual_seed(1)
    return task.build_model(args), task


def placements():
    """Every registered placement: the built-ins, and ours once the extension is loaded."""
    from fairseq_normplug.models.placements import PLACEMENTS

    return list(PLACEMENTS)


def test_the_placement_is_registered_beside_the_built_ins():
    assert placements()[:7] == ["post", "pre", "sandwich", "resi-dual", "b2t", "mix", "hybrid"]
    assert placements()[-1] == "parallel"


def test_parallel_layer_formula(corpus):
    """x + Attn(LN_attn(x)) + FFN(LN_ffn(x)) for an encoder layer, written out by hand."""
    model, _ = build_model(corpus, "--norm-placement", "parallel", "--dropout", "0")
    model.eval()
    layer = model.encoder.layers[0]
    x = torch.randn(5, 2, 64)
    with torch.no_grad():
        h = layer.self_attn_layer_norm(x)
        attention = layer.self_attn(query=h, key=h, value=h, key_padding_mask=None, need_weights=False)[0]
        ffn = layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
        torch.testing.assert_close(layer(x, encoder_padding_mask=None), x + attention + ffn)
    assert model.encoder.layer_norm is not None and model.decoder.layer_norm is not None
    with pytest.raises(NormplugError, match="^--residual-scale rezero cannot be combined with --norm-placement parallel"):
        build_model(corpus, "--norm-placement", "parallel", "--residual-scale", "rezero")


@pytest.mark.parametrize("placement", placements() + ["parallel"])  # collected before the extension is loaded
def test_every_placement_trains_and_decodes_incrementally(extension, corpus, placement):
    model, task = build_model(corpus, "--norm-type", "prmsnorm", "--prms-p", "0.5", "--norm-placement", placement,
                              "--dropout", "0")
    norms = [m for m in model.modules() if type(m).__name__ == "PartialRMSNorm"]
    assert norms and all(norm.partial == norm.dim // 2 for norm in norms)  # --prms-p 0.5 reached every one
    assert not any(type(m).__name__ == "LayerNorm" for m in model.modules())
    source, target = task.source_dictionary, task.target_dictionary
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(source.nspecial, len(source), (2, 6), generator=generator)
    prev = torch.randint(target.nspecial, len(target), (2, 5), generator=generator)
    prev[:, 0] = target.eos()
    lengths = torch.full((2,), 6)
    with torch.no_grad():  # off the init, whose zero gates (Hyper-Connections' dynamic scales) pass no gradient
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))
    model.train()
    logits = model(src, lengths, prev)[0]
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).sum().backward()
    untrained = [name for name, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not untrained, untrained
    model.eval()
    with torch.no_grad():
        full = model(src, lengths, prev)[0]
        encoder_out = model.encoder(src, src_lengths=lengths)
        state = {}
        steps = [model.decoder(prev[:, :t + 1], encoder_out=encoder_out, incremental_state=state)[0][:, -1]
                 for t in range(prev.size(1))]
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=1e-4, atol=1e-5)


TRAIN = ["--task", "translation", "--arch", "transformer_normplug_tiny", "--optimizer", "adam", "--lr", "2e-3",
         "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10", "--criterion", "label_smoothed_cross_entropy",
         "--max-tokens", "1000", "--cpu", "--num-workers", "0", "--seed", "1", "--no-epoch-checkpoints",
         "--disable-validation", "--log-format", "json", "--log-interval", "5", "--max-update", "20"]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """20 updates of a pRMSNorm model with parallel layers and activation checkpointing, the
    extension given only on the command line, as a relative path (run from another folder, so
    nothing but the flag can find it)."""
    save_dir = tmp_path_factory.mktemp("checkpoints")
    proc = run(f"{BIN}/fairseq-train", corpus, "--user-dir", USER_DIR, *TRAIN, "--save-dir", save_dir,
               "--normplug-modules", os.path.relpath(EXTENSION, save_dir), "--norm-type", "prmsnorm", "--prms-p", "0.25",
               "--norm-placement", "parallel", "--checkpoint-activations",
               "--norm-stats-interval", "5", cwd=str(save_dir))
    return save_dir, proc.stdout + proc.stderr


def saved_model_args(path):
    from fairseq import checkpoint_utils

    return checkpoint_utils.load_checkpoint_to_cpu(str(path))["cfg"]["model"]


@pytest.mark.slow
def test_fairseq_train_takes_the_norm_and_its_flag_and_records_the_extension(trained):
    save_dir, log = trained
    assert '"train_num_updates": "20"' in log
    assert '"gain:dec.final"' in log and '"in_std:enc1.ffn"' in log  # the norm statistics, as a built-in's
    args = saved_model_args(save_dir / "checkpoint_last.pt")
    assert args.norm_type == "prmsnorm" and args.prms_p == 0.25 and args.norm_placement == "parallel"
    assert args.normplug_modules == EXTENSION  # recorded absolute, so any folder can decode it


@pytest.mark.slow
def test_fairseq_generate_and_the_hub_decode_without_being_told(trained, corpus):
    """fairseq-generate as a process of its own; fairseq-interactive, fairseq-validate and the hub in
    this process, each after the extension is taken out of it (``run_here``)."""
    from fairseq_normplug.models import TransformerNormplugModel

    save_dir, _ = trained
    proc = run(f"{BIN}/fairseq-generate", corpus, "--user-dir", USER_DIR, "--path", save_dir / "checkpoint_last.pt",
               "--beam", "2", "--max-len-b", "20", "--cpu", "--batch-size", "16", cwd=str(save_dir))
    assert "Generate test with beam=2" in proc.stdout + proc.stderr
    interactive = run_here("interactive", corpus, "--user-dir", USER_DIR, "--path", save_dir / "checkpoint_last.pt",
                           "--cpu", "--beam", "2", "--source-lang", "src", "--target-lang", "tgt",
                           input_text="w1 w2 w3\n", cwd=str(save_dir))
    assert interactive.count("\nH-0\t") == 1
    validate = run_here("validate", corpus, "--user-dir", USER_DIR, "--path", save_dir / "checkpoint_last.pt",
                        "--cpu", "--task", "translation", "--valid-subset", "valid", "--max-tokens", "1000",
                        cwd=str(save_dir))
    assert "| valid on 'valid' subset | loss" in validate
    unload_extension()
    hub = TransformerNormplugModel.from_pretrained(str(save_dir), "checkpoint_last.pt", corpus)
    norms = [m for m in hub.models[0].modules() if type(m).__name__ == "PartialRMSNorm"]
    hub.translate("w1 w2 w3")
    assert type(hub.models[0].decoder.layers[1].placement).__name__ == "ParallelLayers"
    # 2+2 layers and 2 final norms, d=64, p=0.25
    assert len(norms) == 2 * 2 + 2 * 3 + 2 and {m.partial for m in norms} == {16}


@pytest.mark.slow
def test_fairseq_hydra_train_takes_the_extension_as_an_override(corpus, tmp_path):
    """``model.normplug_modules=PATH`` on the hydra command line loads it before hydra checks the
    model's keys, so the norm type and its own flag are accepted there too."""
    run(sys.executable, "-m", "fairseq_normplug.hydra_train", "task=translation_normplug", f"task.data={corpus}",
        "model=transformer_normplug_tiny", "criterion=label_smoothed_cross_entropy", "optimizer=adam",
        "lr_scheduler=inverse_sqrt", "optimization.lr=[0.001]", "optimization.max_update=2", "dataset.max_tokens=1000",
        "dataset.disable_validation=true", "common.cpu=true", f"checkpoint.save_dir={tmp_path}",
        f"+model.normplug_modules={EXTENSION}", "+model.norm_type=prmsnorm", "+model.prms_p=0.5",
        "+model.norm_placement=parallel", cwd=str(tmp_path))
    args = saved_model_args(tmp_path / "checkpoint_last.pt")
    assert (args["norm_type"], args["prms_p"], args["norm_placement"]) == ("prmsnorm", 0.5, "parallel")
    assert args["normplug_modules"] == EXTENSION


@pytest.mark.slow
def test_a_moved_extension_is_named_in_one_line(trained, corpus, tmp_path):
    save_dir, _ = trained
    state = torch.load(save_dir / "checkpoint_last.pt", weights_only=False)
    state["cfg"]["model"].normplug_modules = str(tmp_path / "moved" / "normplug_extension_example")
    torch.save(state, tmp_path / "moved.pt")
    proc = run(f"{BIN}/fairseq-generate", corpus, "--user-dir", USER_DIR, "--path", tmp_path / "moved.pt",
               "--cpu", "--batch-size", "16", check=False, cwd=str(tmp_path))
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "normplug_extension_example" in line]
    assert len(lines) == 1 and "does not exist" in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # pointed to its new place, as the line says (in this process, the extension taken out of it first)
    output = run_here("generate", corpus, "--user-dir", USER_DIR, "--path", tmp_path / "moved.pt", "--cpu",
                      "--batch-size", "16", "--model-overrides", repr({"normplug_modules": EXTENSION}),
                      cwd=str(tmp_path))
    assert "Generate test with beam=" in output


@pytest.mark.slow
def test_an_installed_package_is_loaded_through_its_entry_point(tmp_path):
    """What ``pip install examples/normplug_extension`` leaves: the package on the path and its
    distribution's entry point; nothing else names the extension."""
    info = tmp_path / "normplug_extension_example-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: normplug-extension-example\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[fairseq_normplug.extensions]\nnormplug_extension_example = normplug_extension_example\n")
    path = os.pathsep.join([str(tmp_path), os.path.dirname(EXTENSION), os.environ.get("PYTHONPATH", "")])
    proc = run(sys.executable, "-c", "import fairseq_normplug\nfrom fairseq_normplug.modules.norm_registry import "
               "NORM_TYPES\nprint(NORM_TYPES['prmsnorm'].source)", env={"PYTHONPATH": path}, cwd=str(tmp_path))
    assert proc.stdout.strip().splitlines()[-1] == "normplug_extension_example.partial_rms_norm"


@pytest.mark.slow
def test_the_environment_variable_loads_it_in_any_command(tmp_path):
    proc = run(sys.executable, "-c", "import fairseq_normplug\nfrom fairseq_normplug.models.placements import "
               "PLACEMENTS\nprint(PLACEMENTS['parallel'].__module__)", env={"NORMPLUG_MODULES": EXTENSION},
               cwd=str(tmp_path))
    assert proc.stdout.strip().splitlines()[-1] == "normplug_extension_example.parallel_layers"
