"""A trained translation checkpoint with the data folder it was trained on, run on real
batches: the input and output of every norm site, attention statistics, dev loss and dev BLEU.

Bad input fails in one line, before any model is run: a missing or unreadable checkpoint,
a model that is not a fairseq Transformer, a data folder without binarized data, or a data
folder whose dictionaries do not match the checkpoint's embeddings.
"""
import argparse
import math
import os
from argparse import Namespace
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from fairseq import checkpoint_utils, tasks, utils
from fairseq.models.transformer import TransformerModel
from torch import nn

from fairseq_normplug.checkpoint_compat import load_error
from fairseq_normplug.cli import user_dir
from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments import bleu
from fairseq_normplug.experiments.run_commands import subword_method
from fairseq_normplug.models.norm_placement import named_norms

#: fairseq-generate settings of the dev BLEU, the same for every stage of a report (beam 4,
#: fairseq's --lenpen 0.6, lengths capped for speed; not the recipes' GNMT decoder)
DEFAULT_GENERATION = {"beam": 4, "lenpen": 0.6, "max_len_a": 1.2, "max_len_b": 10}


@dataclass
class LoadedCheckpoint:
    """``state``: the checkpoint as fairseq loads it (``cfg``, ``model``, ...);
    ``data_bin``: the binarized folder; ``bpe``: its subword method (``--remove-bpe`` value)."""

    path: str
    state: dict
    task: object
    model: TransformerModel
    data_bin: str
    bpe: str

    @property
    def cfg(self):
        return self.state["cfg"]


def checkpoint_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The command line of a diagnostics script: help from its module docstring ``doc``, the
    positional CKPT and DATA; the script adds its output argument and options."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=doc.split("\n\n", 1)[1])
    parser.add_argument("checkpoint", help="trained checkpoint (transformer_normplug or transformer)")
    parser.add_argument("data", help="the data folder it was trained on (prepared folder or its bin/)")
    return parser


def resolve_data(data_dir: str) -> Tuple[str, str]:
    """(binarized folder, subword method) of a prepared data folder (``scripts/prepare_*.sh``
    output, holding ``bin/``) or of a fairseq-preprocess output folder."""
    data_bin = os.path.join(data_dir, "bin") if os.path.isdir(os.path.join(data_dir, "bin")) else data_dir
    if not os.path.isdir(data_bin) or not any(
            name.startswith("dict.") for name in os.listdir(data_bin)):
        raise NormplugError(f"{data_dir} is not a binarized data folder (no dict.*.txt in it or in "
                            f"its bin/); pass the folder the model was trained on")
    prepared = data_dir if data_bin != data_dir else os.path.dirname(os.path.abspath(data_bin))
    if not os.path.exists(os.path.join(prepared, "manifest.json")):
        # a plain fairseq-preprocess folder: removing subword-nmt's "@@ " is a no-op without BPE
        return os.path.abspath(data_bin), "subword_nmt"
    return os.path.abspath(data_bin), subword_method(prepared)


def _read_state(path: str, data_bin: str) -> dict:
    if not os.path.isfile(path):
        raise NormplugError(f"no such checkpoint: {path}")
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(path, {"data": data_bin})
    except NormplugError:  # refused or unreadable (checkpoint_compat, through fairseq's loader)
        raise
    except Exception as error:  # torch/pickle raise many kinds on a file that is not a checkpoint
        raise load_error(path, error) from None
    if state.get("cfg") is None or "model" not in state:
        raise NormplugError(f"{path} is not a fairseq training checkpoint (no cfg/model in it)")
    return state


def _check_dictionaries(state: dict, task, path: str, data_dir: str) -> None:
    weights = state["model"]
    for side, key, dictionary in (
            ("source", "encoder.embed_tokens.weight", task.source_dictionary),
            ("target", "decoder.embed_tokens.weight", task.target_dictionary)):
        rows = weights[key].shape[0] if key in weights else None
        if rows is not None and rows != len(dictionary):
            raise NormplugError(
                f"{data_dir} does not match {path}: its {side} dictionary has {len(dictionary)} "
                f"entries, the checkpoint's {side} embeddings {rows} rows; pass the data folder "
                f"the model was trained on")


def load_checkpoint(path: str, data_dir: str) -> LoadedCheckpoint:
    """Load ``path`` (a ``transformer_normplug`` or stock ``transformer`` checkpoint) with
    the dictionaries and data of ``data_dir``, in evaluation mode on the CPU."""
    data_bin, bpe = resolve_data(data_dir)
    state = _read_state(path, data_bin)
    utils.import_user_module(Namespace(user_dir=user_dir()))
    cfg = state["cfg"]
    arch = getattr(cfg.model, "arch", None) or getattr(cfg.model, "_name", None)
    try:
        task = tasks.setup_task(cfg.task, from_checkpoint=True)
    except FileNotFoundError as error:
        raise NormplugError(f"{data_dir} does not hold the checkpoint's dictionaries "
                            f"({os.path.basename(str(error.filename or error))} missing); "
                            f"pass the data folder the model was trained on") from None
    _check_dictionaries(state, task, path, data_dir)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([path], task=task, state=state)
    model = models[0]
    if not isinstance(model, TransformerModel):
        raise NormplugError(f"{path} holds a {arch} model; expected a fairseq Transformer "
                            f"(transformer_normplug or transformer)")
    model.eval()
    return LoadedCheckpoint(path=path, state=state, task=task, model=model, data_bin=data_bin, bpe=bpe)


def batches(task, split: str, max_tokens: int, limit_tokens: Optional[int] = None,
            seed: int = 1) -> Iterator[dict]:
    """Batches of ``split`` (up to ``max_tokens`` source tokens each). With
    ``limit_tokens``, a random selection of batches (fixed ``seed``, so every length range
    can appear) until that many source tokens are reached; otherwise the whole split in order."""
    task.load_dataset(split)
    dataset = task.dataset(split)
    iterator = task.get_batch_iterator(
        dataset, max_tokens=max_tokens, max_positions=utils.resolve_max_positions(
            task.max_positions(), (1024, 1024)),
        ignore_invalid_inputs=True, required_batch_size_multiple=1, seed=seed, num_workers=0,
    ).next_epoch_itr(shuffle=limit_tokens is not None)
    seen = 0
    for sample in iterator:
        if not sample:
            continue
        yield sample
        seen += int(sample["net_input"]["src_tokens"].ne(task.source_dictionary.pad()).sum())
        if limit_tokens is not None and seen >= limit_tokens:
            return


def padding_masks(task, sample: dict) -> Dict[str, torch.Tensor]:
    """{"enc": source mask, "dec": target-side mask}: True at real (non-padding) positions,
    shaped (batch, time)."""
    net = sample["net_input"]
    return {"enc": net["src_tokens"].ne(task.source_dictionary.pad()),
            "dec": net["prev_output_tokens"].ne(task.target_dictionary.pad())}


def real_rows(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The (time, batch, C) or (batch, time, C) ``tensor`` at the real positions of the
    (batch, time) ``mask``, as a (rows, C) float32 matrix."""
    if tensor.shape[:2] == mask.t().shape:
        mask = mask.t()
    return tensor.detach().float()[mask]


@contextmanager
def norm_recorder(model) -> Iterator[Dict[str, dict]]:
    """Forward hooks on every norm site (``named_norms``); yields {site: {"module": norm,
    "x": [inputs], "y": [outputs]}}, filled as the model runs: the full (time, batch, C)
    tensors of each forward pass (see :func:`collect_norm_activations`)."""
    records = {name: {"module": norm, "x": [], "y": []} for name, norm in named_norms(model).items()}

    def hook(name):
        def record(module, inputs, output):
            records[name]["x"].append(inputs[0].detach())
            records[name]["y"].append(output.detach())
        return record

    handles = [norm.register_forward_hook(hook(name)) for name, norm in named_norms(model).items()]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def collect_norm_activations(loaded: LoadedCheckpoint, samples: List[dict]
                             ) -> Dict[str, Tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    """{site: (norm module, inputs, outputs)} at the real (non-padding) token positions of
    ``samples`` (teacher-forced forward passes in evaluation mode), each a (rows, C) matrix."""
    xs: Dict[str, list] = {}
    ys: Dict[str, list] = {}
    with norm_recorder(loaded.model) as records:
        for masks in teacher_forced(loaded, samples):
            for name, entry in records.items():
                mask = masks[name[:3]]
                xs.setdefault(name, []).extend(real_rows(x, mask) for x in entry["x"])
                ys.setdefault(name, []).extend(real_rows(y, mask) for y in entry["y"])
                entry["x"].clear()
                entry["y"].clear()
    return {name: (records[name]["module"], torch.cat(xs[name]), torch.cat(ys[name])) for name in xs}


def teacher_forced(loaded: LoadedCheckpoint, samples: List[dict]) -> Iterator[Dict[str, torch.Tensor]]:
    """Run the model on each sample (teacher forcing, no gradients) and yield the sample's
    :func:`padding_masks` after its forward pass, for hooks to pick their rows."""
    with torch.no_grad():
        for sample in samples:
            loaded.model(**sample["net_input"])
            yield padding_masks(loaded.task, sample)


def dev_loss(model, task, criterion, max_tokens: int = 4000, split: str = "valid") -> Dict[str, float]:
    """fairseq's validation numbers on ``split``: ``loss`` (the criterion's, base 2, per
    target token as fairseq-train's valid_loss) and ``nll_loss`` (base 2)."""
    model.eval()
    totals = {"loss": 0.0, "nll_loss": 0.0, "ntokens": 0.0, "sample_size": 0.0}
    with torch.no_grad():
        for sample in batches(task, split, max_tokens):
            _, sample_size, logging_output = criterion(model, sample)
            for key in ("loss", "nll_loss", "ntokens"):
                totals[key] += float(logging_output.get(key, logging_output["loss"] if key == "nll_loss" else 0))
            totals["sample_size"] += float(sample_size)
    return {"loss": totals["loss"] / totals["sample_size"] / math.log(2),
            "nll_loss": totals["nll_loss"] / totals["ntokens"] / math.log(2)}


def dev_translations(model, task, bpe: str, generation: Optional[dict] = None, max_tokens: int = 4000,
                     split: str = "valid") -> Tuple[List[str], List[str]]:
    """(hypotheses, references) of ``split`` in sentence order, subwords removed, as
    ``fairseq-generate --remove-bpe`` writes its H- and T- lines."""
    settings = {**DEFAULT_GENERATION, **(generation or {})}
    generator = task.build_generator([model], Namespace(**settings))
    tgt_dict = task.target_dictionary
    hyps, refs = {}, {}
    model.eval()
    with torch.no_grad():
        for sample in batches(task, split, max_tokens):
            outputs = task.inference_step(generator, [model], sample)
            for i, sentence_id in enumerate(sample["id"].tolist()):
                hyps[sentence_id] = tgt_dict.string(outputs[i][0]["tokens"].int(), bpe)
                target = utils.strip_pad(sample["target"][i], tgt_dict.pad()).int()
                refs[sentence_id] = tgt_dict.string(target, bpe, escape_unk=True)
    order = sorted(hyps)
    return [hyps[i] for i in order], [refs[i] for i in order]


def evaluate_model(model, task, criterion, bpe: str, generation: Optional[dict] = None,
                   with_bleu: bool = True) -> Dict[str, float]:
    """Dev loss, nll loss and (``with_bleu``) tokenized dev BLEU of ``model``."""
    result = dev_loss(model, task, criterion)
    if with_bleu:
        hyps, refs = dev_translations(model, task, bpe, generation)
        result["bleu"] = bleu.tokenized_bleu(hyps, refs).score
    return result
