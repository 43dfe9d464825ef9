"""Small corpora in the real source layouts, built by the tests themselves (offline).

- :func:`make_ted_archive`: ``ted_talks.tar.gz`` with ``all_talks_{train,dev,test}.tsv``:
  header ``talk_name`` + language columns, tokenized text, missing cells as ``__NULL__``,
  ``_ _ NULL _ _`` or empty.
- :func:`make_raw_corpus`: an untokenized WMT-like corpus ``{train,dev,test}.{en,de}``.
- :func:`make_wmt14_archives`: the five WMT'14 archives of fairseq's recipe, tiny.
- :func:`make_iwslt15_dir`: the six Stanford IWSLT'15 en-vi files, tiny.
"""
import io
import os
import random
import tarfile
from typing import Dict, List, Tuple

TED_LANGS = ("en", "gl", "pt-br", "sk", "he")
TED_ROWS = {"train": 240, "dev": 30, "test": 30}
LONG_TOKENS = 300  # longer than the default --max-len 250

_WORDS = ("the talk about water and light shows how people build small things every day "
          "when we think of cities or music science grows with children who ask questions").split()


def _words(rng: random.Random, n: int) -> List[str]:
    return [rng.choice(_WORDS) for _ in range(n)]


def _in_lang(lang: str, words: List[str]) -> str:
    """A made-up but deterministic 'translation' of ``words`` into ``lang``."""
    if lang == "en":
        return " ".join(words)
    if lang == "he":
        return " ".join("".join(chr(0x05D0 + (ord(c) - 97) % 27) for c in w) for w in words)
    return " ".join(f"{w[::-1]}{lang[0]}" for w in words)


def ted_rows(seed: int = 7) -> Dict[str, List[Dict[str, str]]]:
    """Rows per TSV split: ``{lang: cell}``; some cells missing, one long train row."""
    rng = random.Random(seed)
    markers = ("__NULL__", "_ _ NULL _ _", "")
    rows = {}
    for split, count in TED_ROWS.items():
        rows[split] = []
        for i in range(count):
            words = _words(rng, rng.randint(3, 12)) + [rng.choice([".", "?", ","]), "it", "'s"]
            if split in ("train", "test") and i == 5:
                words = _words(rng, LONG_TOKENS)
            row = {lang: _in_lang(lang, words) for lang in TED_LANGS}
            if i % 7 == 3:  # gl missing
                row["gl"] = markers[i % 3]
            if i % 11 == 4:  # en missing
                row["en"] = markers[(i + 1) % 3]
            if i % 5 == 1:  # pt-br missing
                row["pt-br"] = "__NULL__"
            rows[split].append(row)
    return rows


def expected_pair(rows: Dict[str, List[Dict[str, str]]], src: str, tgt: str) -> Dict[str, List[Tuple[str, str]]]:
    """What extraction must keep: per fairseq split, the (src, tgt) cells of complete rows."""
    def present(cell: str) -> bool:
        return bool(cell.strip()) and "NULL" not in cell
    return {{"dev": "valid"}.get(split, split): [(row[src], row[tgt]) for row in split_rows
                                               if present(row[src]) and present(row[tgt])]
            for split, split_rows in rows.items()}


def make_ted_archive(path: str, rows=None, langs=TED_LANGS) -> str:
    rows = rows or ted_rows()
    with tarfile.open(path, "w:gz") as tar:
        for split, split_rows in rows.items():
            lines = ["\t".join(("talk_name",) + tuple(langs))]
            lines += ["\t".join([f"talk_{i // 10}"] + [row[lang] for lang in langs])
                      for i, row in enumerate(split_rows)]
            _add(tar, f"all_talks_{split}.tsv", "\n".join(lines) + "\n")
    return path


def _add(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode("utf-8")
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


# --- untokenized WMT-like text --------------------------------------------------------

_EN = ["The \u201cbest\u201d state-of-the-art system costs $1,000.50, doesn't it?",
       "Dr. Smith said: it's a well-known fact (really).",
       "Water, light & music \u2013 all in one day\u2026",
       "We think of cities; children ask questions!"]


def _de(en: str) -> str:
    return en.replace("The", "Das").replace("it", "es").replace("and", "und").replace("day", "Tag")


def raw_pairs(count: int, seed: int) -> List[Tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        en = " ".join(rng.sample(_EN, 2)) + " " + " ".join(_words(rng, rng.randint(2, 8))) + "."
        pairs.append((en, _de(en)))
    return pairs


def write_pairs(folder: str, split: str, pairs, src: str = "en", tgt: str = "de") -> None:
    os.makedirs(folder, exist_ok=True)
    for lang, column in ((src, 0), (tgt, 1)):
        with open(os.path.join(folder, f"{split}.{lang}"), "w", encoding="utf-8") as f:
            f.writelines(pair[column] + "\n" for pair in pairs)


def make_raw_corpus(folder: str) -> Dict[str, List[Tuple[str, str]]]:
    """``{train,dev,test}.{en,de}``; train has one over-long pair and one with an empty side."""
    splits = {"train": raw_pairs(200, 1), "dev": raw_pairs(20, 2), "test": raw_pairs(20, 3)}
    long_en = " ".join(["word"] * LONG_TOKENS)
    splits["train"][10] = (long_en, _de(long_en))
    splits["train"][20] = ("Only English here.", "")
    splits["test"][3] = (long_en, _de(long_en))
    for split, pairs in splits.items():
        write_pairs(folder, split, pairs)
    return splits


# --- WMT'14 archives -----------------------------------------------------------------

WMT_TRAIN_MEMBERS = {
    "training-parallel-europarl-v7.tgz": "training/europarl-v7.de-en",
    "training-parallel-commoncrawl.tgz": "commoncrawl.de-en",
    "training-parallel-nc-v9.tgz": "training/news-commentary-v9.de-en",
}


def _sgm(lines: List[str], lang: str, kind: str) -> str:
    body = "\n".join(f'<seg id="{i + 1}">{line}</seg>' for i, line in enumerate(lines))
    return (f'<{kind} setid="newstest2014" srclang="any" trglang="{lang}">\n'
            f'<doc sysid="ref" docid="1" genre="news" origlang="en">\n<p>\n{body}\n</p>\n</doc>\n</{kind}>\n')


def make_wmt14_archives(folder: str) -> Dict[str, List[Tuple[str, str]]]:
    """The five archives; returns the pairs of each train corpus and of dev/test."""
    os.makedirs(folder, exist_ok=True)
    content = {}
    for seed, (archive, member) in enumerate(WMT_TRAIN_MEMBERS.items()):
        pairs = raw_pairs(60, 10 + seed)
        if seed == 0:
            pairs[7] = ("one two three four five six seven", "eins")  # length ratio > 1.5
        content[member] = pairs
        with tarfile.open(os.path.join(folder, archive), "w:gz") as tar:
            if seed == 0:  # another language pair in the same archive, as in Europarl
                _add(tar, "training/europarl-v7.fr-en.fr", "Bonjour.\n")
            for lang, column in (("de", 1), ("en", 0)):
                _add(tar, f"{member}.{lang}", "\n".join(p[column] for p in pairs) + "\n")
    content["dev"] = raw_pairs(15, 20)
    with tarfile.open(os.path.join(folder, "dev.tgz"), "w:gz") as tar:
        for lang, column in (("en", 0), ("de", 1)):
            _add(tar, f"dev/newstest2013.{lang}", "\n".join(p[column] for p in content["dev"]) + "\n")
    content["test"] = raw_pairs(12, 30)
    content["test"][0] = ("It\u2019s here.", "Es ist \u2019hier\u2019.")
    with tarfile.open(os.path.join(folder, "test-full.tgz"), "w:gz") as tar:
        for lang, column in (("en", 0), ("de", 1)):
            lines = [p[column] for p in content["test"]]
            _add(tar, f"test-full/newstest2014-deen-src.{lang}.sgm", _sgm(lines, lang, "srcset"))
            _add(tar, f"test-full/newstest2014-deen-ref.{lang}.sgm", _sgm(lines, lang, "refset"))
    return content


# --- IWSLT'15 files --------------------------------------------------------------------

def make_iwslt15_dir(folder: str) -> Dict[str, int]:
    """train/tst2012/tst2013 .{en,vi}, tokenized with Moses escapes; returns line counts."""
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(5)
    counts = {"train": 150, "tst2012": 20, "tst2013": 25}
    for name, count in counts.items():
        en, vi = [], []
        for _ in range(count):
            words = _words(rng, rng.randint(3, 10))
            en.append(" ".join(words) + " , it &apos;s &quot; true &quot; .")
            vi.append(" ".join(f"{w}\u1ec7" for w in words) + " , đó là &quot; thật &quot; .")
        for lang, lines in (("en", en), ("vi", vi)):
            with open(os.path.join(folder, f"{name}.{lang}"), "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)
    return counts
