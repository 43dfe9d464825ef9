"""fairseq-normplug-ct2 (issue 61, docs/deployment.md): a model CTranslate2 can express exports
exactly (its greedy translations equal fairseq-generate's at beam 1, sentence for sentence); any
other is refused in one line, and an export whose check fails leaves nothing behind.

Tiny models (d=64, 2+2 layers) trained in this process for a few epochs of the tiny corpus, so
their translations are real ones of varied lengths; skipped where ctranslate2 is not installed
(``pip install fairseq-normplug[export]``; the test set-up installs it)."""
import contextlib
import io
import json
import os
import re
import sys

import pytest
import torch

ctranslate2 = pytest.importorskip("ctranslate2")

from conftest import REPO  # noqa: E402
from inprocess import run_fairseq  # noqa: E402
from model_helpers import build, save_checkpoint, train_briefly  # noqa: E402
from test_cli import NO_LOADER_WORKERS  # noqa: E402

from fairseq_normplug.export import ct2, ct2_spec  # noqa: E402
from fairseq_normplug.export.ct2_convert import MAX_LEN_B  # noqa: E402

TINY = "transformer_normplug_tiny"
USER_DIR = os.path.join(REPO, "fairseq_normplug")
#: the designs the issue names, each exported exactly
EXACT = {
    "postnorm": [],
    "prenorm": ["--prenorm"],
    "prenorm-rmsnorm": ["--prenorm", "--rmsnorm"],
    "prenorm-scalenorm": ["--prenorm", "--scalenorm"],
    "tears": ["--prenorm", "--fixnorm", "--scalenorm", "--smallinit"],
}
SENTENCES = 20


@pytest.fixture(scope="session")
def checkpoints(tiny_bin, tmp_path_factory):
    """``get(flags, trained=True)``: the path of a tiny checkpoint with ``flags`` (built once a
    session), trained for 80 updates of 500 tokens (about 40k tokens, 1.2 epochs; no dropout)
    unless ``trained`` is False: enough for translations of varied lengths, most of which end."""
    folder = tmp_path_factory.mktemp("ct2-checkpoints")
    made = {}

    def get(flags, trained=True):
        key = (tuple(flags), trained)
        if key not in made:
            model, task, args = build(tiny_bin, TINY, "--dropout", "0", *flags, seed=0)
            if trained:
                first, last = train_briefly(model, task, updates=80, lr=3e-3, epochs=10, max_tokens=500)
                assert last < 0.6 * first, (flags, first, last)
            made[key] = save_checkpoint(model, args, folder / f"model{len(made)}.pt")
        return made[key]

    return get


def export(checkpoint, data, output, *extra):
    """``fairseq-normplug-ct2`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = ct2.main(["--model_path", str(checkpoint), "--data_dir", str(data), "--output_dir", str(output),
                             *extra])
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def test_sentences(tiny_raw, tiny_bin, tmp_path_factory):
    """A data folder whose test split is the first 20 sentences of ``tiny_raw``'s test split,
    binarized with ``tiny_bin``'s dictionaries."""
    raw = tmp_path_factory.mktemp("test20-raw")
    for lang in ("src", "tgt"):
        with open(os.path.join(tiny_raw, f"test.{lang}")) as f:
            (raw / f"test.{lang}").write_text("".join(f.readlines()[:SENTENCES]))
    dest = str(tmp_path_factory.mktemp("test20-bin"))
    run_fairseq(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--testpref", f"{raw}/test",
                 "--srcdict", f"{tiny_bin}/dict.src.txt", "--tgtdict", f"{tiny_bin}/dict.tgt.txt",
                 "--destdir", dest, "--workers", "1"])
    return dest


def fairseq_generate_greedy(checkpoint, data):
    """{sentence id: (source, hypothesis)} of fairseq-generate --beam 1 on the test split of ``data``."""
    proc = run_fairseq(["fairseq-generate", data, "--user-dir", USER_DIR, "--path", checkpoint, "--cpu",
                        "--gen-subset", "test", "--beam", "1", "--batch-size", str(SENTENCES),
                        "--required-batch-size-multiple", "1", "--source-lang", "src", "--target-lang", "tgt",
                        *NO_LOADER_WORKERS])
    sources = dict(re.findall(r"^S-(\d+)\t(.*)$", proc.stdout, flags=re.M))
    hypotheses = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", proc.stdout, flags=re.M))
    return {int(i): (sources[i], hypotheses[i]) for i in hypotheses}


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_the_export_translates_as_fairseq_generate_does(checkpoints, tiny_bin, test_sentences, tmp_path, name):
    """Issue 61's acceptance: greedy translations of 20 test sentences identical to fairseq-generate's
    at beam 1 (20/20); the norms' epsilon carried over (ScaleNorm's eps folded to eps^2/d); the
    export's own check (20 valid sentences) reported."""
    checkpoint = checkpoints(EXACT[name])
    output = tmp_path / "ct2"
    code, stdout, stderr = export(checkpoint, tiny_bin, output)
    assert code == 0, stderr
    assert "(20/20)" in stdout
    reference = fairseq_generate_greedy(checkpoint, test_sentences)
    ids = sorted(reference)
    assert len(ids) == SENTENCES
    translator = ctranslate2.Translator(str(output), device="cpu", intra_threads=1)
    results = translator.translate_batch([reference[i][0].split() for i in ids], beam_size=1, min_decoding_length=1,
                                         max_decoding_length=MAX_LEN_B)
    exported = [" ".join(result.hypotheses[0]) for result in results]
    expected = [reference[i][1] for i in ids]
    assert exported == expected
    assert len({len(h.split()) for h in expected}) > 3 and len(set(expected)) > SENTENCES // 2  # varied
    config = json.loads((output / "config.json").read_text())
    eps = 1e-5 ** 2 / 64 if "scalenorm" in " ".join(EXACT[name]) else 1e-5
    assert config["layer_norm_epsilon"] == pytest.approx(eps, rel=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["ct2"]  # no temporary folder left


@pytest.mark.slow
def test_the_recipes_output_layer_exports_exactly(tiny_bin, tmp_path):
    """The authors' output layer (--target-vocab-mask --output-bias) with the full method: a masked
    type given the largest output bias would win every step without the mask; the export keeps
    it at probability 0, as the model does (the check passes), and never emits it."""
    model, task, args = build(tiny_bin, TINY, "--prenorm", "--fixnorm", "--scalenorm", "--smallinit",
                              "--target-vocab-mask", "--output-bias", seed=0)
    dictionary = task.target_dictionary
    masked = next(int(i) for i in (~model.decoder.target_vocab_mask.allowed).nonzero()
                  if dictionary[int(i)].isalpha() and dictionary[int(i)].islower()
                  and not dictionary[int(i)].startswith("madeupword"))  # a source word (joined dictionary)
    with torch.no_grad():
        model.decoder.output_projection.bias[masked] = 100.0
    checkpoint = save_checkpoint(model, args, tmp_path / "recipe.pt")
    code, stdout, stderr = export(checkpoint, tiny_bin, tmp_path / "ct2", "--check_sentences", "5")
    assert code == 0 and "(5/5)" in stdout, stderr
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    words = translator.translate_batch([["zo", "tu"]], beam_size=1, max_decoding_length=20)[0].hypotheses[0]
    assert words and dictionary[masked] not in words


def assert_refused(code, stderr, output, *words):
    """One line on stderr (no traceback) naming every one of ``words``, exit status 2, no
    output and no temporary folder beside it."""
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fairseq-normplug: error: "), stderr
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]
    parent = os.path.dirname(output)
    assert not os.path.exists(output) and (not os.path.exists(parent) or os.listdir(parent) == [])


@pytest.mark.parametrize("flags,words", [
    (["--prenorm", "--dyt"], ["--norm-type dyt", "DynamicTanh", "LayerNorm or RMSNorm only"]),
    (["--prenorm", "--norm-type", "derf"], ["--norm-type derf"]),
    (["--norm-placement", "sandwich"], ["--norm-placement sandwich", "no spec"]),
    (["--prenorm", "--normformer"], ["--normformer", "no spec"]),
    (["--residual-scale", "deepnorm"], ["--residual-scale deepnorm", "x + F(x)"]),
    (["--prenorm", "--qknorm", "--qknorm-g0", "5"], ["self_attn.q_proj", "HeadNormProjection"]),
    (["--prenorm", "--cross-self-attention"], ["--cross-self-attention"]),
    (["--prenorm", "--activation-fn", "tanh"], ["--activation-fn tanh"]),  # CTranslate2's converter's own check
])
def test_what_ctranslate2_cannot_express_is_refused_in_one_line(checkpoints, tiny_bin, tmp_path, flags, words):
    code, _, stderr = export(checkpoints(flags, trained=False), tiny_bin, tmp_path / "out" / "ct2")
    assert_refused(code, stderr, str(tmp_path / "out" / "ct2"), "cannot export to CTranslate2", *words)


@pytest.mark.slow
def test_an_export_that_translates_differently_is_deleted(checkpoints, tiny_bin, tmp_path, monkeypatch):
    """ScaleNorm written as an RMSNorm with gain g instead of g/sqrt(d) (a wrong fold): the
    check finds the different translations, and neither the output nor a temporary folder is left."""
    def wrong_fold(module):
        norm = ct2_spec.scale_norm(module)
        return ct2_spec.Norm(True, norm.gamma * module.dim ** 0.5, None, norm.eps)

    monkeypatch.setitem(ct2_spec.NORM_WRITERS, ct2_spec.ScaleNorm, wrong_fold)
    output = tmp_path / "out" / "ct2"
    code, _, stderr = export(checkpoints(EXACT["prenorm-scalenorm"]), tiny_bin, output)
    assert_refused(code, stderr, str(output), "translates valid sentence", "differently", "nothing was written")


@pytest.mark.slow
def test_an_existing_output_is_kept_without_force(checkpoints, tiny_bin, tmp_path):
    output = tmp_path / "ct2"
    output.mkdir()
    (output / "mine.txt").write_text("keep")
    code, _, stderr = export(checkpoints(EXACT["prenorm"]), tiny_bin, output)
    assert code == 2 and "already exists; pass --force" in stderr and os.listdir(output) == ["mine.txt"]
    code, _, stderr = export(checkpoints(EXACT["prenorm"]), tiny_bin, output, "--force")
    assert code == 0 and "model.bin" in os.listdir(output) and "mine.txt" not in os.listdir(output)
    assert sorted(os.listdir(tmp_path)) == ["ct2"]


def test_quantization_is_refused_with_the_load_time_alternative(checkpoints, tiny_bin, tmp_path):
    output = tmp_path / "out" / "ct2"
    code, _, stderr = export(checkpoints(EXACT["prenorm"], trained=False), tiny_bin, output, "--quantization", "int8")
    assert_refused(code, stderr, str(output), "--quantization int8", "compute_type='int8'")


def test_without_ctranslate2_one_line_names_the_extra(checkpoints, tiny_bin, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 -> ImportError
    output = tmp_path / "out" / "ct2"
    code, _, stderr = export(checkpoints(EXACT["prenorm"], trained=False), tiny_bin, output)
    assert_refused(code, stderr, str(output), "fairseq-normplug[export]")


def test_the_scalenorm_fold_is_the_same_function():
    """g x / max(||x||, eps) and the RMSNorm it is written as, (g/sqrt(d)) x / sqrt(mean(x^2) +
    eps^2/d), agree to well within float32 precision for inputs with ||x|| >= ~1e3 eps (the
    relative difference is eps^2 / (2 ||x||^2), docs/deployment.md)."""
    from fairseq_normplug.modules.rms_norm import rms_norm_reference
    from fairseq_normplug.modules.scale_norm import ScaleNorm, scale_norm_reference

    module = ScaleNorm(64, eps=1e-5)
    with torch.no_grad():
        module.g.fill_(3.7)
    norm = ct2_spec.scale_norm(module)
    x = torch.randn(50, 64, dtype=torch.float64) * torch.logspace(-2, 2, 50, dtype=torch.float64)[:, None]
    torch.testing.assert_close(rms_norm_reference(x, norm.gamma.double(), norm.eps),
                               scale_norm_reference(x, module.g.double(), module.eps), rtol=1e-8, atol=0)
