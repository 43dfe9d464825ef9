"""``--seeds``: the training seeds of a table's cells, for every pair (``1 2 3``) or for one
pair (``PAIR=N,N,...``)."""
import dataclasses
import re
from typing import Mapping, Sequence, Tuple, Union

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.configs import check_pair


@dataclasses.dataclass(frozen=True)
class PairSeeds:
    """The training seeds of each pair (``--seeds 1 2 3 az-en=1,2``): ``default`` for every pair
    that ``per_pair`` does not name, ``per_pair`` {pair: its seeds} for the others."""
    default: Tuple[int, ...] = (1,)
    per_pair: Mapping[str, Tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def of(self, pair: str) -> Tuple[int, ...]:
        """The seeds that ``pair`` trains and collects."""
        return self.per_pair.get(pair, self.default)

    def check_pairs(self, pairs: Sequence[str]) -> None:
        """A ``PAIR=`` entry for a pair that is not run here is refused (NormplugError)."""
        for pair, seeds in self.per_pair.items():
            if pair not in pairs:
                raise NormplugError(f"--seeds {pair}={','.join(map(str, seeds))}: {pair} is not a pair of this "
                                    f"run; choose from {', '.join(pairs)}")

    def describe(self, pairs: Sequence[str]) -> str:
        """``de-en 1 2 3, az-en 1 2``: each pair's seeds."""
        return ", ".join(f"{pair} {' '.join(map(str, self.of(pair)))}" for pair in pairs)


#: what :func:`plan_runs` takes as seeds: one list for every pair, or :class:`PairSeeds`
Seeds = Union[Sequence[int], PairSeeds]


def pair_seeds(seeds: Seeds) -> PairSeeds:
    """``seeds`` as :class:`PairSeeds` (one list of seeds: the same on every pair)."""
    return seeds if isinstance(seeds, PairSeeds) else PairSeeds(default=tuple(seeds))


def _seed_list(text: str, entry: str) -> Tuple[int, ...]:
    """The distinct non-negative integers of ``text`` (``1,2``), or a one-line NormplugError."""
    seeds = []
    for item in text.split(","):
        if not re.fullmatch(r"[0-9]+", item):
            raise NormplugError(f"--seeds {entry}: {item!r} is not a seed (a non-negative integer); "
                                f"write N ... or PAIR=N,N,...")
        seeds.append(int(item))
    if len(set(seeds)) != len(seeds):
        raise NormplugError(f"--seeds must be distinct non-negative integers, got {entry}")
    return tuple(seeds)


def parse_seeds(values: Sequence[str]) -> PairSeeds:
    """``--seeds``: plain numbers are every pair's seeds (default 1), ``PAIR=N,N,...`` one pair's
    instead (``--seeds 1 2 3 az-en=1,2``: de-en seeds 1, 2, 3 and az-en seeds 1, 2). A bad
    number, a repeated seed or a pair named twice is a one-line NormplugError."""
    default, per_pair = [], {}
    for value in values:
        if "=" not in value:
            default.extend(_seed_list(value, value))
            continue
        pair, text = value.split("=", 1)
        pair = check_pair(pair, "--seeds")
        if pair in per_pair:
            raise NormplugError(f"--seeds names {pair} twice ({pair}={','.join(map(str, per_pair[pair]))} and "
                                f"{value}); give each pair one PAIR=N,N,... entry")
        per_pair[pair] = _seed_list(text, value)
    if len(set(default)) != len(default):
        raise NormplugError(f"--seeds must be distinct non-negative integers, got {default}")
    return PairSeeds(default=tuple(default) or (1,), per_pair=per_pair)
