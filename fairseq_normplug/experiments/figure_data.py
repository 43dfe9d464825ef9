"""What the figures plot, before any drawing: the training logs of each label (one per seed),
several seeds combined into a band (mean, min-max), and norm names (``dec1.cross``) parsed and
put in forward order."""
import math
import re
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.training_log import TrainingLog, missing_records_cause
from fairseq_normplug.models.norm_placement import norm_short_names

#: {label: one log, or the logs of the label's seeds}
Logs = Dict[str, Union[TrainingLog, Sequence[TrainingLog]]]
Groups = Dict[str, List[TrainingLog]]
#: a norm's name (``norm_placement.named_norms``): stack, layer (none for a stack's own norm) and
#: the slot's short name, which any registered placement or modifier may define
NORM_NAME = re.compile(r"^(?P<stack>enc|dec)(?P<layer>\d+)?\.(?P<sublayer>\w+)$")
SUBLAYER_ORDER = {"attn": 0, "cross": 1, "ffn": 2}
STACK_ORDER = {"enc": 0, "dec": 1}


class MissingLogData(NormplugError):
    """None of the given logs holds the keys a figure needs."""


class SeedBand(NamedTuple):
    """One label's seeds at each x: ``mean``, ``low`` (min), ``high`` (max) over the ``seeds``
    seeds that have a value at that x."""
    xs: list
    mean: List[float]
    low: List[float]
    high: List[float]
    seeds: List[int]


Series = Union[Tuple[list, List[float]], SeedBand]


def seed_band(per_seed: Sequence[Tuple[Sequence, Sequence[float]]]) -> SeedBand:
    """The band of several seeds' (xs, ys): at each x that some seed has (numbers sorted,
    names in first-seen order), the mean, min and max of the seeds' values there."""
    values: Dict[object, List[float]] = {}
    for xs, ys in per_seed:
        for x, y in zip(xs, ys):
            values.setdefault(x, []).append(y)
    xs = list(values)
    if all(isinstance(x, (int, float)) for x in xs):
        xs.sort()
    return SeedBand(xs=xs, mean=[sum(values[x]) / len(values[x]) for x in xs], low=[min(values[x]) for x in xs],
                    high=[max(values[x]) for x in xs], seeds=[len(values[x]) for x in xs])


def combine_seeds(per_seed: Sequence[Tuple[Sequence, Sequence[float]]]) -> Series:
    """One seed's (xs, ys) as they are; several seeds as their :func:`seed_band`."""
    if len(per_seed) == 1:
        xs, ys = per_seed[0]
        return list(xs), list(ys)
    return seed_band(per_seed)


def as_groups(logs: Logs) -> Groups:
    """{label: [log, ...]}: a single log becomes a one-seed list."""
    return {label: [group] if isinstance(group, TrainingLog) else list(group) for label, group in logs.items()}


def parse_norm_name(name: str) -> Tuple[str, Optional[int], str]:
    """``dec1.cross`` -> ("dec", 1, "cross"); ``enc.final`` -> ("enc", None, "final")."""
    match = NORM_NAME.match(name)
    if not match:
        raise NormplugError(f"unknown norm name {name!r} (expected e.g. enc0.attn, dec1.cross, dec.final)")
    layer = match.group("layer")
    return match.group("stack"), None if layer is None else int(layer), match.group("sublayer")


def norm_sort_key(name: str) -> Tuple[int, float, int, int, str]:
    """Forward order of norm names: encoder before decoder, layer by layer (the slots of the
    self-attention, cross-attention, FFN in turn, by their short name's first part, ``attn_out``
    with ``attn``; within one, the registry's order; slots of designs not loaded here last),
    the stack's final norm last."""
    stack, layer, sublayer = parse_norm_name(name)
    slots = norm_short_names()
    order = slots.index(sublayer) if sublayer in slots else len(slots)
    part = SUBLAYER_ORDER.get(sublayer.split("_")[0], len(SUBLAYER_ORDER))
    return STACK_ORDER[stack], math.inf if layer is None else layer, part, order, sublayer


def _sorted_norms(values: Dict[str, float]) -> Dict[str, float]:
    return {name: values[name] for name in sorted(values, key=norm_sort_key)}


def _logs_with(logs: Logs, select: Callable[[TrainingLog], bool], figure: str, need: str,
               kind: str = "train_inner") -> Groups:
    """{label: its seeds' logs that hold what the figure needs (in records of ``kind``)},
    labels without any left out; none at all is :class:`MissingLogData`, naming the log
    format when that is the cause."""
    chosen = {}
    groups = as_groups(logs)
    for label, group in groups.items():
        kept = [log for log in group if select(log)]
        if kept:
            chosen[label] = kept
    if not chosen:
        cause = missing_records_cause([log for group in groups.values() for log in group], kind)
        raise MissingLogData(f"{figure}: no log has {need}" + (f" ({cause})" if cause else ""))
    return chosen
