"""The authors' recipe where the paper is silent (issue 19, docs/fidelity.md): the runner's
fairseq-train commands of the TED/IWSLT rows share one joint embedding with the authors'
output bias and target-vocabulary mask and use torch's Adam betas; WMT'14 keeps fairseq's."""
import json

import pytest
from fairseq import options

from fairseq_normplug.experiments.configs import load_table
from fairseq_normplug.experiments.runner import Run, last_flag_value
from fairseq_normplug.modules.fixnorm_embedding import FixNormEmbedding
from model_helpers import build

AUTHORS_OUTPUT_LAYER = ["--share-all-embeddings", "--target-vocab-mask", "--output-bias"]


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    return tmp_path


def train_command(table, pair, data_dir, row=0):
    table = load_table(table)
    return Run(table=table, row=table.rows[row], pair=pair, data_dir=str(data_dir),
               run_dir=str(data_dir / "run")).train_command()


@pytest.mark.parametrize("table,pair", [("table3", "gl-en"), ("table3", "en-vi"), ("table4", "ar-en"),
                                        ("beyond", "sk-en")])
def test_ted_and_iwslt_rows_train_with_the_authors_output_layer_and_betas(data_dir, table, pair):
    command = train_command(table, pair, data_dir)
    assert all(flag in command for flag in AUTHORS_OUTPUT_LAYER)
    assert last_flag_value(command, "--criterion") == "masked_label_smoothed_cross_entropy"
    assert last_flag_value(command, "--label-smoothing") == "0.1"
    assert last_flag_value(command, "--adam-betas") == "(0.9, 0.999)"


def test_cpu_recipes_keep_the_choices_of_their_documented_numbers(data_dir):
    """The demo (cpu_small, cpu_tiny) keeps what docs/experiments.md measured: tied target
    embedding only, fairseq's label smoothing, betas (0.9, 0.98) (docs/fidelity.md, deviation 1)."""
    command = train_command("demo", "src-tgt", data_dir)
    assert not any(flag in command for flag in AUTHORS_OUTPUT_LAYER)
    assert last_flag_value(command, "--criterion") == "label_smoothed_cross_entropy"
    assert last_flag_value(command, "--adam-betas") == "(0.9, 0.98)"


def test_wmt14_keeps_fairseqs_recipe(data_dir):
    command = train_command("table6", "en-de", data_dir)
    assert last_flag_value(command, "--adam-betas") == "(0.9, 0.98)"
    assert last_flag_value(command, "--criterion") == "label_smoothed_cross_entropy"
    assert "--share-all-embeddings" in command
    assert "--target-vocab-mask" not in command and "--output-bias" not in command


def test_the_ted_command_parses_and_its_model_shares_one_embedding(tiny_bin, data_dir):
    """fairseq's own parser accepts the runner's TED command (nothing refused), and the TED
    preset with those flags and FixNorm (at 1+1 layers here) has one embedding matrix for the
    encoder input, the decoder input and the output layer, with the mask and output bias."""
    command = train_command("table3", "gl-en", data_dir, row=3)  # PreNorm + FixNorm + ScaleNorm
    argv = [tiny_bin if arg.endswith("/bin") else arg for arg in command[1:]]
    argv[argv.index("--source-lang") + 1], argv[argv.index("--target-lang") + 1] = "src", "tgt"
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    assert args.arch == "transformer_normplug_ted" and args.fixnorm and args.share_all_embeddings
    assert args.target_vocab_mask and args.output_bias and eval(args.adam_betas) == (0.9, 0.999)

    model, task, _ = build(tiny_bin, "transformer_normplug_ted", *AUTHORS_OUTPUT_LAYER, "--fixnorm", "--prenorm",
                           "--scalenorm", "--encoder-layers", "1", "--decoder-layers", "1",
                           task="translation_normplug")
    embedding = model.encoder.embed_tokens
    assert isinstance(embedding, FixNormEmbedding) and model.decoder.embed_tokens is embedding
    assert model.decoder.output_projection.weight is embedding.weight
    assert model.decoder.output_projection.bias.shape == (len(task.target_dictionary),)
    assert 0 < int(model.decoder.target_vocab_mask.allowed.sum()) < len(task.target_dictionary)
