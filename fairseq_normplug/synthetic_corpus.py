"""A built-in SYNTHETIC parallel corpus: no download, deterministic, learnable in minutes.

It is not natural language. Each source "word" is a made-up token with a fixed translation
(a bijective word map), and the target reorders each adjacent pair of words, so a model
must learn both a lexicon and local reordering, the two things a tiny NMT system can learn
on 2 CPU cores. Word frequencies follow a Zipf law, as in real text.

    python -m fairseq_normplug.synthetic_corpus OUT_DIR [--train 20000 --valid 500 --test 500]

writes ``{train,valid,test}.{src,tgt}`` (languages ``src`` and ``tgt``) plus a README.
"""
import argparse
import os
import random
from typing import List, Tuple

from fairseq_normplug.atomic_files import write_text_atomic

SRC_LANG, TGT_LANG = "src", "tgt"
_CONSONANTS = "bcdfghklmnprstvz"
_VOWELS = "aeiou"


def _make_words(rng: random.Random, count: int, syllables: Tuple[int, int]) -> List[str]:
    words, seen = [], set()
    while len(words) < count:
        n = rng.randint(*syllables)
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(n))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def make_lexicon(vocab_size: int = 400, seed: int = 1) -> Tuple[List[str], dict]:
    """Source words and their fixed translations (disjoint word sets)."""
    rng = random.Random(seed)
    words = _make_words(rng, 2 * vocab_size, (1, 3))
    src_words, tgt_words = words[:vocab_size], [w.upper() for w in words[vocab_size:]]
    return src_words, dict(zip(src_words, tgt_words))


def translate(src_tokens: List[str], lexicon: dict) -> List[str]:
    """The corpus's 'grammar': map each word, then swap each adjacent pair."""
    out = [lexicon[w] for w in src_tokens]
    for i in range(0, len(out) - 1, 2):
        out[i], out[i + 1] = out[i + 1], out[i]
    return out


def generate_pairs(count: int, seed: int, vocab_size: int = 400, min_len: int = 3, max_len: int = 14):
    src_words, lexicon = make_lexicon(vocab_size)
    weights = [1.0 / (rank + 1) for rank in range(len(src_words))]
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(min_len, max_len)
        src = rng.choices(src_words, weights=weights, k=n)
        yield " ".join(src), " ".join(translate(src, lexicon))


def write_corpus(out_dir: str, train: int = 20000, valid: int = 500, test: int = 500,
                 vocab_size: int = 400) -> str:
    """Write the corpus atomically (:mod:`fairseq_normplug.atomic_files`); return ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    for split, count, seed in (("train", train, 11), ("valid", valid, 22), ("test", test, 33)):
        pairs = list(generate_pairs(count, seed, vocab_size))
        for lang, column in ((SRC_LANG, 0), (TGT_LANG, 1)):
            path = os.path.join(out_dir, f"{split}.{lang}")
            write_text_atomic(path, "".join(pair[column] + "\n" for pair in pairs))
    with open(os.path.join(out_dir, "README"), "w", encoding="utf-8") as f:
        f.write(
            "SYNTHETIC corpus made by fairseq_normplug.synthetic_corpus: made-up words, a fixed\n"
            "word-for-word lexicon and pairwise reordering. Not natural language; BLEU on it\n"
            "only shows that training works, it says nothing about real translation quality.\n"
        )
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=20000)
    parser.add_argument("--valid", type=int, default=500)
    parser.add_argument("--test", type=int, default=500)
    parser.add_argument("--vocab-size", type=int, default=400)
    args = parser.parse_args(argv)
    for name in ("train", "valid", "test", "vocab_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    print(write_corpus(args.out_dir, args.train, args.valid, args.test, args.vocab_size))


if __name__ == "__main__":
    main()
