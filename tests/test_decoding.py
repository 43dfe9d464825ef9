"""Decoding as the authors decode (issue 19): the per-sentence length cap, and the authors' beam
search (--gnmt-search) against fairseq's search re-ranked by --gnmt-alpha, on hand-made
log-probabilities and through fairseq-generate."""
import json
import math
import os
import re
from argparse import Namespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.models import FairseqEncoder, FairseqEncoderDecoderModel, FairseqIncrementalDecoder
from fairseq.sequence_generator import SequenceGenerator

from model_helpers import build, randomized
from test_cli import NO_LOADER_WORKERS
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.tasks.gnmt_generator import GnmtSequenceGenerator, gnmt_length_penalty
from fairseq_normplug.tasks.gnmt_search import GnmtBeamSearchGenerator
from fairseq_normplug.tasks.length_cap import LengthCappedEnsembleModel, SentenceLengthCap, force_eos_at_cap
from fairseq_normplug.tasks.translation_normplug import TranslationNormplugConfig, TranslationNormplugTask

TINY = "transformer_normplug_tiny"
USER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fairseq_normplug")
EOS = "</s>"


def lp(length):
    return gnmt_length_penalty(length, 0.6)


# ---- the cap itself ------------------------------------------------------------------------

def test_sentence_length_cap_is_fairseqs_formula_per_sentence():
    lengths = torch.tensor([1, 2, 8, 13, 40])  # EOS included
    caps = SentenceLengthCap(1.2, 10, limit=1023)(lengths)
    assert caps.tolist() == [int(1.2 * n + 10) for n in lengths.tolist()] == [11, 12, 19, 25, 58]
    assert SentenceLengthCap(1, 50, limit=1023)(lengths).tolist() == [51, 52, 58, 63, 90]  # source + 50
    assert SentenceLengthCap(1, 50, limit=60)(lengths).tolist() == [51, 52, 58, 60, 60]  # positions
    assert SentenceLengthCap(0.5, 0, limit=1023, min_len=2)(lengths).tolist() == [2, 2, 4, 6, 20]
    batch = SentenceLengthCap(1.2, 10, limit=1023, per_sentence=False)(lengths, src_width=40)
    assert batch.tolist() == [int(1.2 * 40 + 10)] * 5  # fairseq's: the padded width, every row


def test_force_eos_at_cap_closes_only_the_rows_at_their_cap():
    lprobs = torch.log_softmax(torch.randn(3, 6, generator=torch.Generator().manual_seed(0)), dim=-1)
    capped = force_eos_at_cap(lprobs.clone(), step=4, caps=torch.tensor([4, 5, 2]), eos=2)
    assert torch.equal(capped[1], lprobs[1])  # cap 5 > step 4: untouched
    for row in (0, 2):
        assert capped[row, 2] == lprobs[row, 2] and torch.isinf(capped[row, [0, 1, 3, 4, 5]]).all()


# ---- hand-made log-probabilities -----------------------------------------------------------

class TreeEncoder(FairseqEncoder):
    def forward(self, src_tokens, src_lengths):
        return {"src_tokens": [src_tokens], "src_lengths": [src_lengths.view(-1, 1)]}

    def reorder_encoder_out(self, encoder_out, new_order):
        return {key: [value[0].index_select(0, new_order)] for key, value in encoder_out.items()}


class TreeDecoder(FairseqIncrementalDecoder):
    """Next-token probabilities read from a hand-made tree {prefix of words: {word: p}} (the
    start symbol left out); a prefix not in the tree gets ``default``; every other type 1e-12."""

    def __init__(self, dictionary, tree, default):
        super().__init__(dictionary)
        self.tree, self.default = tree, default

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None):
        rows = []
        for prefix in prev_output_tokens[:, 1:].tolist():
            probs = self.tree.get(tuple(self.dictionary[t] for t in prefix), self.default)
            row = torch.full((len(self.dictionary),), math.log(1e-12))
            for word, p in probs.items():
                row[self.dictionary.index(word)] = math.log(p)
            rows.append(row)
        return torch.stack(rows).unsqueeze(1), None

    def reorder_incremental_state(self, incremental_state, new_order):
        pass


def tree_search(tree, default, sources, task_flags, beam=2, **gen_args):
    """(generator, n-best lists as (words, score)) of the task's generator (``--gnmt-alpha 0.6``
    plus ``task_flags``) on a tree model, the ``sources`` in one batch."""
    d = Dictionary()
    for word in ("x", "y", "z", "u", "v"):
        d.add_symbol(word)
    task = TranslationNormplugTask(TranslationNormplugConfig(**{"gnmt_alpha": 0.6, **task_flags}), d, d)
    model = FairseqEncoderDecoderModel(TreeEncoder(d), TreeDecoder(d, tree, default))
    generator = task.build_generator([model], Namespace(beam=beam, **{"max_len_b": 10, **gen_args}))
    width = max(len(s) for s in sources) + 1
    src = torch.full((len(sources), width), d.pad())
    for i, words in enumerate(sources):  # left-padded, as fairseq's dataset
        src[i, width - len(words) - 1:] = torch.tensor([d.index(w) for w in words] + [d.eos()])
    lengths = torch.tensor([len(s) + 1 for s in sources])
    sample = {"id": torch.arange(len(sources)), "net_input": {"src_tokens": src, "src_lengths": lengths}}
    nbest = task.inference_step(generator, [model], sample)
    return generator, [[(d.string(h["tokens"]), float(h["score"])) for h in hypos] for hypos in nbest]


#: beam 2, alpha 0.6: fairseq finalizes "x" at step 1 and "y u" at step 2, then stops (two
#: hypotheses have ended). The authors' search keeps "x" in its slot, keeps "y u v" open at
#: step 2 (-0.950 beats both "x", -1.053, and "y u", -1.291, by normalised score) and ends it
#: at step 3 at -0.925, better than "x".
DISAGREE = {(): {"x": 0.45, "y": 0.55},
            ("x",): {EOS: 0.7, "z": 0.3},
            ("y",): {"u": 0.98, "z": 0.02},
            ("y", "u"): {"v": 0.6, EOS: 0.4},
            ("y", "u", "v"): {EOS: 0.95, "z": 0.05}}
X, YU, YUV = 0.45 * 0.7, 0.55 * 0.98 * 0.4, 0.55 * 0.98 * 0.6 * 0.95


def test_fairseq_search_with_gnmt_reranking_on_the_hand_made_case():
    generator, (nbest,) = tree_search(DISAGREE, {EOS: 1.0}, [["x"]], {})
    assert type(generator) is GnmtSequenceGenerator
    assert [h for h, _ in nbest] == ["x", "y u"]  # "y u v" was never finished
    assert [s for _, s in nbest] == pytest.approx([math.log(X) / lp(2), math.log(YU) / lp(3)], abs=1e-5)


def test_authors_search_on_the_hand_made_case():
    generator, (nbest,) = tree_search(DISAGREE, {EOS: 1.0}, [["x"]], {"gnmt_search": True})
    assert type(generator) is GnmtBeamSearchGenerator
    assert [h for h, _ in nbest] == ["y u v", "x"]  # "x" kept its slot and its step-1 score
    assert [s for _, s in nbest] == pytest.approx([math.log(YUV) / lp(4), math.log(X) / lp(2)], abs=1e-5)


#: EOS is the likeliest first token (forbidden at the first step), then no hypothesis ever ends
NEVER_ENDS = {(): {EOS: 0.5, "x": 0.3, "z": 0.2}}


@pytest.mark.parametrize("search", [{}, {"gnmt_search": True}])
def test_each_sentence_stops_at_its_own_cap(search):
    sources = [["u", "v"], ["u", "v", "u", "v", "u"]]  # 3 and 6 tokens with EOS: caps 5 and 8
    _, nbest = tree_search(NEVER_ENDS, {"x": 0.6, "z": 0.4}, sources, search, max_len_a=1, max_len_b=2)
    for (best, score), cap in zip((hypos[0] for hypos in nbest), (5, 8)):
        assert best == " ".join(["x"] * cap)  # first step: EOS forbidden; cut at the cap
        if search:  # the authors' score: log P of the cap tokens (the EOS appended is unscored)
            assert score == pytest.approx(math.log(0.3 * 0.6 ** (cap - 1)) / lp(cap), abs=1e-5)
        else:  # fairseq forces an EOS of p = 1e-12 and scores it
            assert score == pytest.approx(math.log(0.3 * 0.6 ** (cap - 1) * 1e-12) / lp(cap + 1), abs=1e-4)
    _, batch_capped = tree_search(NEVER_ENDS, {"x": 0.6, "z": 0.4}, sources,
                                  {**search, "batch_length_cap": True}, max_len_a=1, max_len_b=2)
    assert [hypos[0][0] for hypos in batch_capped] == [" ".join(["x"] * 8)] * 2  # the longest source's


# ---- a real (tiny, seeded) model: hypotheses independent of the batching -------------------

@pytest.fixture(scope="module")
def tiny_model(tiny_bin):
    model, task, args = build(tiny_bin, TINY, task="translation_normplug")
    randomized(model, seed=3)
    model.eval()
    return model, args


SEARCHES = {"fairseq": [], "gnmt-alpha": ["--gnmt-alpha", "0.6"],
            "gnmt-search": ["--gnmt-alpha", "0.6", "--gnmt-search"]}
N = 16  # test sentences decoded


def decode_in_batches(tiny_bin, model, flags, batches):
    """{sentence id: best hypothesis} of the test set decoded in the given groups of ids."""
    _, task, _ = build(tiny_bin, TINY, *flags, task="translation_normplug")
    task.load_dataset("test")
    dataset = task.dataset("test")
    eos_bonus = torch.zeros(len(task.target_dictionary))
    eos_bonus[task.target_dictionary.eos()] = 1.0  # about a third of the hypotheses end before their cap
    output_layer = model.decoder.output_layer
    model.decoder.output_layer = lambda features: output_layer(features) + eos_bonus
    try:
        generator = task.build_generator([model], Namespace(beam=4, max_len_a=1, max_len_b=5))
        best = {}
        for ids in batches:
            sample = dataset.collater([dataset[i] for i in ids])
            for i, hypos in zip(sample["id"].tolist(), task.inference_step(generator, [model], sample)):
                best[i] = hypos[0]["tokens"].tolist()
    finally:
        model.decoder.output_layer = output_layer
    assert sorted(best) == list(range(N))
    return best, generator


def dataset_sizes(tiny_bin):
    _, task, _ = build(tiny_bin, TINY, task="translation_normplug")
    task.load_dataset("test")
    return task.dataset("test").src_sizes  # EOS included


@pytest.mark.parametrize("search", ["fairseq", "gnmt-search"])  # --gnmt-alpha: fairseq's, re-ranked
def test_hypotheses_do_not_depend_on_the_batching(tiny_bin, tiny_model, search):
    model, _ = tiny_model
    ids = list(range(N))
    shuffled = torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()
    alone, _ = decode_in_batches(tiny_bin, model, [*SEARCHES[search], "--batch-length-cap"], [[i] for i in ids])
    one_batch, generator = decode_in_batches(tiny_bin, model, SEARCHES[search], [shuffled])
    small_batches, _ = decode_in_batches(tiny_bin, model, SEARCHES[search], [ids[i::6] for i in range(6)])
    assert one_batch == small_batches == alone  # = fairseq's own cap, each sentence in a batch of its own
    sizes = dataset_sizes(tiny_bin)
    ended_early = [len(one_batch[i]) < sizes[i] + 5 + 1 for i in ids]  # the cap a = 1, b = 5, and EOS
    assert 0 < sum(ended_early) < len(ids)  # some hypotheses end before their cap, some at it
    if search != "gnmt-search":
        assert isinstance(generator.model, LengthCappedEnsembleModel)
    batch_capped, _ = decode_in_batches(tiny_bin, model, [*SEARCHES[search], "--batch-length-cap"], [shuffled])
    assert sum(batch_capped[i] != one_batch[i] for i in ids) >= N // 4  # fairseq's cap: the batch's longest


def test_dev_bleu_decodes_with_the_same_generators(tiny_bin):
    gen_args = json.dumps({"beam": 4, "max_len_a": 1, "max_len_b": 50})
    for search, kind in (("fairseq", SequenceGenerator), ("gnmt-alpha", GnmtSequenceGenerator),
                         ("gnmt-search", GnmtBeamSearchGenerator)):
        model, task, args = build(tiny_bin, TINY, "--eval-bleu", "--eval-bleu-args", gen_args, *SEARCHES[search],
                                  task="translation_normplug")
        task.build_model(args)  # builds the dev-BLEU generator
        generator = task.sequence_generator
        assert type(generator) is kind and generator.beam_size == 4
        cap = generator.length_cap if kind is GnmtBeamSearchGenerator else generator.model.length_cap
        assert (cap.max_len_a, cap.max_len_b, cap.per_sentence) == (1, 50, True)


# ---- fairseq-generate ----------------------------------------------------------------------

def test_fairseq_generate_with_gnmt_search_is_batch_independent(tiny_bin, tiny_model, tmp_path):
    """fairseq-generate's main() (in process: batches of 60 tokens, sorted by length) and the
    task's generator (30 of the sentences, in two shuffled batches) give the same hypotheses."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_cli import generate
    from omegaconf import OmegaConf

    model, args = tiny_model
    path = str(tmp_path / "checkpoint.pt")
    torch.save({"cfg": OmegaConf.to_container(convert_namespace_to_omegaconf(args), resolve=True,
                                              enum_to_str=True),
                "model": model.state_dict(), "args": None, "extra_state": {},
                "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "SGD",
                                       "lr_scheduler_state": {}, "num_updates": 0}]}, path)
    argv = [tiny_bin, "--user-dir", USER_DIR, "--path", path, "--cpu", "--task", "translation_normplug",
            "--gnmt-alpha", "0.6", "--gnmt-search", "--beam", "4", "--max-len-a", "1", "--max-len-b", "5",
            "--max-tokens", "60", "--required-batch-size-multiple", "1", "--gen-subset", "test",
            "--source-lang", "src", "--target-lang", "tgt", "--results-path", str(tmp_path), *NO_LOADER_WORKERS]
    generate.main(options.parse_args_and_arch(options.get_generation_parser(), argv))
    text = (tmp_path / "generate-test.txt").read_text()
    hypotheses = {int(i): h for i, h in re.findall(r"^H-(\d+)\t\S+\t(.*)$", text, flags=re.M)}
    assert sorted(hypotheses) == list(range(100))
    _, task, _ = build(tiny_bin, TINY, *SEARCHES["gnmt-search"], task="translation_normplug")
    task.load_dataset("test")
    dataset = task.dataset("test")
    generator = task.build_generator([model], Namespace(beam=4, max_len_a=1, max_len_b=5))
    shuffled = torch.randperm(100, generator=torch.Generator().manual_seed(1))[:30].tolist()
    ours = {}
    for batch in (shuffled[::2], shuffled[1::2]):
        sample = dataset.collater([dataset[i] for i in batch])
        for i, hypos in zip(sample["id"].tolist(), task.inference_step(generator, [model], sample)):
            ours[i] = task.target_dictionary.string(hypos[0]["tokens"])
    assert ours == {i: hypotheses[i] for i in shuffled}


@pytest.mark.parametrize("flags,gen,message", [
    (["--gnmt-search"], {}, "--gnmt-search needs --gnmt-alpha"),
    (SEARCHES["gnmt-search"], {"sampling": True}, "--gnmt-search does not support --sampling"),
    (SEARCHES["gnmt-search"], {"print_alignment": "hard"}, "--gnmt-search does not support --print-alignment"),
])
def test_unsupported_combinations_are_one_line_errors(tiny_bin, flags, gen, message):
    with pytest.raises(NormplugError, match=re.escape(message)):
        model, task, _ = build(tiny_bin, TINY, *flags, task="translation_normplug")
        task.build_generator([model], Namespace(beam=4, **gen))


# ---- the recipes' decoding specs -----------------------------------------------------------

def _recipe_run(table_name, pair, tmp_path):
    from fairseq_normplug.experiments.configs import load_table
    from fairseq_normplug.experiments.runner import Run

    (tmp_path / "manifest.json").write_text(json.dumps({"subword_method": "subword_nmt"}))
    table = load_table(table_name)
    return Run(table=table, row=table.rows[0], pair=pair, data_dir=str(tmp_path), run_dir=str(tmp_path / "run"))


@pytest.mark.parametrize("table,pair", [("table3", "gl-en"), ("table3", "en-vi")])
def test_ted_and_iwslt_decode_with_the_authors_search_and_source_plus_50(tmp_path, table, pair):
    from fairseq_normplug.experiments.runner import generate_command, last_flag_value

    run = _recipe_run(table, pair, tmp_path)
    assert run.recipe.name == ("iwslt15" if pair == "en-vi" else "ted")
    train, test = run.train_command(), generate_command(run, "best.pt")
    assert json.loads(last_flag_value(train, "--eval-bleu-args")) == {"beam": 4, "max_len_a": 1, "max_len_b": 50}
    assert [last_flag_value(test, f) for f in ("--beam", "--max-len-a", "--max-len-b")] == ["4", "1", "50"]
    for command in (train, test):
        assert last_flag_value(command, "--gnmt-alpha") == "0.6" and "--gnmt-search" in command
        assert "--batch-length-cap" not in command and "--lenpen" not in command


def test_cpu_and_wmt_recipes_decoding(tmp_path):
    from fairseq_normplug.experiments.runner import decoding_task_flags, generate_command, last_flag_value

    demo = generate_command(_recipe_run("demo", "src-tgt", tmp_path), "best.pt")
    assert [last_flag_value(demo, f) for f in ("--beam", "--max-len-a", "--max-len-b")] == ["1", "1.2", "10"]
    assert "--batch-length-cap" not in demo
    wmt = generate_command(_recipe_run("table6", "en-de", tmp_path), "best.pt")
    assert last_flag_value(wmt, "--lenpen") == "0.6" and "--gnmt-search" not in wmt
    assert last_flag_value(wmt, "--max-len-a") == "0"  # a = 0: one cap, fairseq's recipe
    assert decoding_task_flags({"beam": 4, "gnmt_alpha": 0.6, "batch_length_cap": True}) == \
        ["--gnmt-alpha", "0.6", "--batch-length-cap"]


@pytest.mark.parametrize("decoding,message", [
    ({"gnmt_alpha": None}, "has gnmt_search but no gnmt_alpha"),
    ({"gnmt_search": "yes"}, "gnmt_search must be true, false or null, got 'yes'"),
    ({"batch_length_cap": 1}, "batch_length_cap must be true, false or null, got 1"),
])
def test_bad_decoding_specs_are_one_line_errors(tmp_path, decoding, message):
    import shutil

    from fairseq_normplug.experiments.configs import CONFIG_DIR, load_recipes

    shutil.copytree(CONFIG_DIR, tmp_path / "configs")
    path = tmp_path / "configs" / "recipes.json"
    recipes = json.loads(path.read_text())
    recipes["iwslt15"]["decoding"] = decoding
    path.write_text(json.dumps(recipes))
    with pytest.raises(NormplugError, match=re.escape(message)) as error:
        load_recipes(str(tmp_path / "configs"))
    assert "recipe 'iwslt15'" in str(error.value)
