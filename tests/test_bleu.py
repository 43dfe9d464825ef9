"""BLEU scoring, significance and fairseq-generate parsing (fairseq_normplug.experiments.bleu)."""
import json
import math
import random

import pytest
import sacrebleu
from sacrebleu.metrics import BLEU

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu

# Two sentences whose n-gram statistics are worked out by hand below.
HAND_HYPS = ["the cat sat on the mat", "a dog runs"]
HAND_REFS = ["the cat sat on a mat", "the dog runs fast"]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_tokenized_bleu_matches_a_hand_computation():
    # 1-grams: the(clipped 1) cat sat on mat = 5/6, dog runs = 2/3 -> 7/9
    # 2-grams: the-cat cat-sat sat-on of 5, dog-runs of 2 -> 4/7
    # 3-grams: the-cat-sat cat-sat-on of 4, none of 1 -> 2/5
    # 4-grams: the-cat-sat-on of 3, the second sentence has none -> 1/3
    # lengths 9 vs 10 -> BP = exp(1 - 10/9)
    score = bleu.tokenized_bleu(HAND_HYPS, HAND_REFS)
    expected_precisions = [7 / 9, 4 / 7, 2 / 5, 1 / 3]
    assert score.precisions == pytest.approx([100 * p for p in expected_precisions])
    assert score.brevity_penalty == pytest.approx(math.exp(1 - 10 / 9))
    assert (score.sys_len, score.ref_len) == (9, 10)
    geometric_mean = math.prod(expected_precisions) ** 0.25
    assert score.score == pytest.approx(100 * math.exp(1 - 10 / 9) * geometric_mean)
    assert "tok:none" in score.signature and "smooth:none" in score.signature


def test_scores_record_the_hypothesis_reference_length_ratio():
    scores = bleu.score_translation(HAND_HYPS, HAND_REFS)
    assert (scores["sys_len"], scores["ref_len"]) == (9, 10) and scores["length_ratio"] == pytest.approx(0.9)
    # scores.json written before length_ratio existed: from sys_len / ref_len
    assert bleu.length_ratio({"sys_len": 22, "ref_len": 10}) == pytest.approx(2.2)
    assert bleu.length_ratio({"sys_len": 3, "ref_len": 0}) is None and bleu.length_ratio({}) is None


def test_tokenized_bleu_is_multi_bleu_unsmoothed_and_case_sensitive():
    # multi-bleu.perl: a zero 4-gram precision makes BLEU 0 (no smoothing)
    assert bleu.tokenized_bleu(["a b c"], ["a b c d"]).score == 0.0
    assert bleu.tokenized_bleu(["The cat sat down"], ["the cat sat down"]).precisions[0] == 75.0
    # already tokenized: punctuation is not split off again ("down." != "down")
    assert bleu.tokenized_bleu(["the cat sat down."], ["the cat sat down ."]).precisions[0] == 75.0


def test_scores_of_files_match_sacrebleu(tmp_path):
    hyps = ["It &apos;s a test , isn &apos;t it ?", "The results were good .", "no match here"]
    refs = ["It &apos;s a test , is it not ?", "The results were very good .", "nothing matches"]
    hyp_lines = bleu.read_lines(write(tmp_path / "hyp.txt", hyps))
    ref_lines = bleu.read_lines(write(tmp_path / "ref.txt", refs))

    tok = bleu.tokenized_bleu(hyp_lines, ref_lines)
    reference = BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(hyps, [refs])
    assert tok.score == pytest.approx(reference.score)

    detok_hyps, detok_refs = bleu.detokenize(hyp_lines, "en"), bleu.detokenize(ref_lines, "en")
    assert detok_hyps[0] == "It's a test, isn't it?"
    detok = bleu.sacrebleu_detok(detok_hyps, detok_refs, "en")
    assert detok.score == pytest.approx(sacrebleu.corpus_bleu(detok_hyps, [detok_refs]).score)
    assert detok.signature.startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert bleu.sacrebleu_detok(["\u4eca\u5929\u5f88\u597d"], ["\u4eca\u5929\u597d"], "zh").signature.split("|")[3] == "tok:zh"

    scores = bleu.score_translation(hyp_lines, ref_lines, lang="en")
    assert scores["tokenized_bleu"] == tok.score and scores["sacrebleu"] == detok.score
    raw_refs = ["It's a test, is it not?", "The results were very good.", "nothing matches"]
    with_raw = bleu.score_translation(hyp_lines, ref_lines, lang="en", detok_refs=raw_refs)
    assert with_raw["sacrebleu"] == pytest.approx(sacrebleu.corpus_bleu(detok_hyps, [raw_refs]).score)


def test_remove_bpe():
    assert bleu.remove_bpe(["the n@@ ew@@ est word@@", "plain"]) == ["the newest word", "plain"]
    assert bleu.remove_bpe(["\u2581the \u2581new est \u2581word"], "sentencepiece") == ["the newest word"]
    with pytest.raises(NormplugError, match="'wordpiece'"):
        bleu.remove_bpe(["x"], "wordpiece")


def test_compound_splitting_by_hand():
    # perl's s{(\S)-(\S)}{...}g: non-overlapping, left to right, so "a-b-c" keeps its second dash
    assert bleu.compound_split("a state-of-the-art model - really a-b-c") == (
        "a state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art model - really "
        "a ##AT##-##AT## b-c")
    hyp, ref = ["the state-of-the-art model"], ["the state-of-the-art system"]
    # unsplit: 3 tokens, no trigram match -> 0; split: 9 tokens, 8/9 7/8 6/7 5/6, BP 1
    assert bleu.tokenized_bleu(hyp, ref).score == 0.0
    assert bleu.compound_split_bleu(hyp, ref).score == pytest.approx(100 * (5 / 9) ** 0.25)


def _synthetic_systems():
    rng = random.Random(7)
    words = [f"w{i}" for i in range(40)]
    refs = [" ".join(rng.choice(words) for _ in range(10)) for _ in range(60)]

    def corrupt(rate, seed):
        r = random.Random(seed)
        return [" ".join(w if r.random() > rate else "unk" for w in ref.split()) for ref in refs]

    return refs, corrupt(0.5, 1), corrupt(0.1, 2)


def test_paired_bootstrap_p_values():
    refs, weak, strong = _synthetic_systems()
    better = bleu.paired_bootstrap(weak, strong, refs, n_samples=1000)
    assert better.p_value < 0.01
    assert better.system_score == pytest.approx(bleu.tokenized_bleu(strong, refs).score)
    assert better.baseline_score == pytest.approx(bleu.tokenized_bleu(weak, refs).score)
    assert better.system_ci > 0 and abs(better.system_mean - better.system_score) < better.system_ci
    assert "bs:1000" in better.signature and "seed:12345" in better.signature
    assert bleu.paired_bootstrap(weak, strong, refs, n_samples=1000) == better  # seeded

    same = bleu.paired_bootstrap(weak, list(weak), refs, n_samples=1000)
    assert same.p_value > 0.3


def test_mismatched_inputs_are_rejected(tmp_path):
    with pytest.raises(NormplugError, match="2 hypotheses but 3 references"):
        bleu.tokenized_bleu(["a", "b"], ["a", "b", "c"])
    with pytest.raises(NormplugError, match="baseline hypotheses"):
        bleu.paired_bootstrap(["a"], ["a", "b"], ["a", "b"])
    with pytest.raises(NormplugError, match="no such file: .*missing.txt"):
        bleu.read_lines(str(tmp_path / "missing.txt"))
    with pytest.raises(NormplugError, match="still holds BPE"):
        bleu.score_translation(["the n@@ ew word"], ["the new word"])


GENERATE_OUTPUT = """\
S-2\tsource two
T-2\tthe dog runs fast
H-2\t-0.51\ta dog runs
D-2\t-0.51\ta dog runs
P-2\t-0.1 -0.2 -0.3 -0.4
H-2\t-0.90\ta dog
S-0\tsource zero
T-0\tthe cat sat on a mat
H-0\t-0.20\tthe cat sat on the mat
D-0\t-0.20\tthe cat sat on the mat
S-1\tsource one
T-1\tan empty hypothesis
H-1\t-3.00\t
D-1\t-3.00\t
Generate test with beam=4: BLEU4 = 10.00, 1/2/3/4 (BP=1.000, ratio=1.000, syslen=9, reflen=10)
"""


def test_read_fairseq_generate_orders_by_id_and_keeps_the_best_hypothesis(tmp_path):
    path = tmp_path / "gen.out"
    path.write_text(GENERATE_OUTPUT, encoding="utf-8")
    output = bleu.read_fairseq_generate(str(path), expected=3)
    assert output.ids == [0, 1, 2]
    assert output.hypotheses == ["the cat sat on the mat", "", "a dog runs"]
    assert output.detok_hypotheses == output.hypotheses
    assert output.references == ["the cat sat on a mat", "an empty hypothesis", "the dog runs fast"]
    assert bleu.read_fairseq_generate(str(path)) == output


def test_read_fairseq_generate_detects_dropped_sentences(tmp_path):
    path = tmp_path / "gen.out"
    path.write_text(GENERATE_OUTPUT, encoding="utf-8")
    with pytest.raises(NormplugError, match=r"3 hypotheses but the reference file has 5 lines "
                                            r"\(missing ids: 3, 4\).*--required-batch-size-multiple 1"):
        bleu.read_fairseq_generate(str(path), expected=5)
    gap = tmp_path / "gap.out"
    gap.write_text("\n".join(line for line in GENERATE_OUTPUT.splitlines() if "-1\t" not in line))
    with pytest.raises(NormplugError, match=r"hypotheses \(H-\) missing for ids 1 of 0..2"):
        bleu.read_fairseq_generate(str(gap))
    with pytest.raises(NormplugError, match="only 2 lines: wrong reference file"):
        bleu.read_fairseq_generate(str(path), expected=2)
    with pytest.raises(NormplugError, match="no H-<id> hypothesis lines"):
        bleu.read_fairseq_generate(write(tmp_path / "text", ["just text"]))


def test_command_line_scores_generate_output(tmp_path, capsys):
    system = tmp_path / "system.out"
    system.write_text(GENERATE_OUTPUT, encoding="utf-8")
    baseline = tmp_path / "baseline.out"
    baseline.write_text(GENERATE_OUTPUT.replace("the cat sat on the mat", "a cat"), encoding="utf-8")
    refs = ["the cat sat on a mat", "an empty hypothesis", "the dog runs fast"]
    out_json = tmp_path / "scores" / "test.json"
    scores = bleu.main(["--generate", str(system), "--ref", write(tmp_path / "ref", refs), "--lang", "en",
                        "--compound-split", "--baseline-generate", str(baseline), "--json", str(out_json)])
    hyps = bleu.read_fairseq_generate(str(system)).hypotheses
    assert scores["tokenized_bleu"] == pytest.approx(bleu.tokenized_bleu(hyps, refs).score)
    assert scores["sentences"] == 3
    assert scores["sacrebleu_signature"].startswith("nrefs:1|")
    assert scores["compound_split_bleu"] == pytest.approx(scores["tokenized_bleu"])  # no hyphens here
    assert scores["baseline_bleu"] < scores["tokenized_bleu"] and 0 < scores["p_value"] <= 1
    assert json.loads(out_json.read_text()) == scores == json.loads(capsys.readouterr().out)
    with pytest.raises(NormplugError, match="3 hypotheses but the reference file has 4 lines"):
        bleu.main(["--generate", str(system), "--ref", write(tmp_path / "ref4", refs + ["more"])])
