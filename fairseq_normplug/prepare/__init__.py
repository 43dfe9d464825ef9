"""Data preparation: public corpora -> fairseq binarized data, as the papers' experiments need.

One command per corpus, each a thin wrapper in ``scripts/`` over a module here:

==============================  ===============================================
``scripts/prepare_ted.sh``      :mod:`fairseq_normplug.prepare.ted` (Qi et al. 2018 TED pairs)
``scripts/prepare_iwslt15.sh``  :mod:`fairseq_normplug.prepare.iwslt15` (en-vi, Stanford NLP)
``scripts/prepare_wmt14.sh``    :mod:`fairseq_normplug.prepare.wmt14` (en-de, fairseq's recipe)
``scripts/prepare_corpus.sh``   :mod:`fairseq_normplug.prepare.corpus` (any raw parallel folder)
==============================  ===============================================

Each corpus module only turns its source into plain parallel text; everything after that
(tokenization, train-only length filtering, joint BPE, ``fairseq-preprocess``, references,
manifest, atomic publication of the output folder) is the common
:mod:`fairseq_normplug.prepare.pipeline`. The output layout is described there and in
``docs/data.md``.
"""
