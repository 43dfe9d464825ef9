"""A checkpoint folder the scripts trained translates without the data folder: through the
plugin's ``from_pretrained`` and ``torch.hub.load(REPO, ..., source="local")`` (hubconf.py),
and the README's fairseq-generate / fairseq-interactive block runs as written. The corpus is
the tiny synthetic one, named gl-en and prepared into ``data/ted/gl-en`` of a work folder;
``scripts/train.sh table3 "PreNorm + FixNorm + ScaleNorm"`` trains the paper's full method
(the TED recipe: one joint embedding, output bias, target-vocabulary mask) at the tiny size
for 4 updates into the run folder the README names."""
import os
import re
import shutil
import subprocess

import pytest
import torch

from conftest import BIN_DIR, REPO, command_env, failure_report
from inprocess import forked_commands

ROW = "PreNorm + FixNorm + ScaleNorm"
RUN = os.path.join("runs", "table3", "gl-en", "prenorm-fixnorm-scalenorm")
TINY = ("--arch transformer_normplug_tiny --max-tokens 1000 --max-update 4 --validate-interval-updates 4 "
        "--max-valid-steps 1")
HUB_FILES = {"dict.gl.txt": "bin/dict.gl.txt", "dict.en.txt": "bin/dict.en.txt", "bpecodes": "bpe/codes"}


@pytest.fixture(scope="module")
def work(tiny_raw, tmp_path_factory):
    """The work folder: ``data/ted/gl-en`` prepared (30 BPE merges) and ROW trained in RUN, by
    the mains of scripts/prepare_corpus.sh and scripts/train.sh (tests/test_entry_points.py runs
    the scripts themselves); the preparation's fairseq-preprocess and the run's fairseq commands
    in forked children of this process (tests/inprocess.py's forked_commands)."""
    from fairseq_normplug.experiments import single_run
    from fairseq_normplug.prepare import corpus

    work = tmp_path_factory.mktemp("hub")
    raw = work / "raw"
    raw.mkdir()
    for split in ("train", "valid", "test"):
        for lang, ours in (("gl", "src"), ("en", "tgt")):
            os.symlink(os.path.join(tiny_raw, f"{split}.{ours}"), raw / f"{split}.{lang}")
    with pytest.MonkeyPatch.context() as patch, forked_commands():
        patch.chdir(work)
        corpus.main([str(raw), "--src", "gl", "--tgt", "en", "--tokenized", "--bpe-merges", "30",
                     "--dest", "data/ted/gl-en", "--workers", "1"])
        with pytest.raises(SystemExit) as trained:
            single_run.train_main(["table3", ROW, "data/ted/gl-en", "--run-dir", RUN, "--train-flags", TINY])
    assert trained.value.code == 0
    return work


@pytest.mark.slow
def test_training_copies_the_dictionaries_and_bpe_codes_beside_the_checkpoints(work):
    checkpoints = work / RUN / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == sorted(["checkpoint_best.pt", "checkpoint_last.pt", *HUB_FILES])
    for name, source in HUB_FILES.items():
        assert (checkpoints / name).read_bytes() == (work / "data" / "ted" / "gl-en" / source).read_bytes()


@pytest.mark.slow
def test_from_pretrained_and_torch_hub_translate_from_the_checkpoint_folder_alone(work, tmp_path):
    from fairseq_normplug.models import TransformerNormplugModel

    folder = shutil.copytree(work / RUN / "checkpoints", tmp_path / "model")
    data = work / "data" / "ted" / "gl-en"
    with open(work / "raw" / "test.gl", encoding="utf-8") as f:
        sentence = f.readline().strip()
    with open(data / "bpe" / "test.gl", encoding="utf-8") as f:
        segmented = f.readline().strip()
    assert "@@" in segmented  # the subword model splits it: BPE is really applied
    moved = shutil.move(str(data), str(work / "data-moved"))  # no data folder while loading
    try:
        model = TransformerNormplugModel.from_pretrained(str(folder), "checkpoint_best.pt")
        hub_model = torch.hub.load(REPO, "transformer_normplug", str(folder), source="local")
    finally:
        shutil.move(moved, str(data))
    assert model.cfg.task.data == str(folder) and type(model.models[0]) is TransformerNormplugModel
    assert type(model.models[0].decoder).__name__ == "FixNormTransformerDecoder"
    # the raw sentence is segmented as the prepare script segmented the test set
    assert model.encode(sentence).tolist() == model.src_dict.encode_line(segmented, add_if_not_exist=False).tolist()
    translation = model.translate(sentence)
    assert translation and "@@" not in translation
    assert hub_model.translate(sentence) == translation


def readme_block(command: str) -> str:
    """The README's bash code block that holds ``command``."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)
    (block,) = [b for b in blocks if command in b]
    return block


@pytest.mark.slow
def test_the_readme_generate_and_interactive_commands_run_as_written(work, tiny_raw):
    block = readme_block("fairseq-interactive")  # run in the environment, as after `source .venv/bin/activate`
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=str(work), capture_output=True, text=True,
                          timeout=600, env=command_env({"PATH": f"{BIN_DIR}{os.pathsep}{os.environ['PATH']}"}))
    assert proc.returncode == 0, failure_report(proc)
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    with open(os.path.join(tiny_raw, "test.src"), encoding="utf-8") as f:
        assert len(hypotheses) - 1 == sum(1 for _ in f)  # the test set, then the interactive sentence
    assert not [h for h in hypotheses if "@@" in h]
    assert re.search(r"Generate test with beam=4: BLEU4 = \d", proc.stdout + proc.stderr)
    # the interactive sentence (the last S-0 line), tokenized and segmented by the copied BPE codes
    lines = proc.stdout.splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("S-0\t"))
    source = lines[last].split("\t")[1]
    assert "@@ " in source and source.replace("@@ ", "").split()[0] == "Ola"
    assert [line for line in lines[last:] if line.startswith("D-0\t")]  # its detokenized translation
