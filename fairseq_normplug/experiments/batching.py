"""Tokens per update: ``--max-tokens`` per device x devices x ``--update-freq``, planned so
that a recipe's ``tokens_per_update`` is reached exactly on any device count."""
import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.configs import Recipe
from fairseq_normplug.flag_lists import last_flag_value


def world_size(flags: List[str], planned: Optional[int] = None) -> int:
    """Devices fairseq-train will use: --distributed-world-size, else the run's planned device
    count, else every visible GPU, else 1."""
    given = last_flag_value(flags, "--distributed-world-size")
    if given:
        return int(given)
    return planned if planned is not None else max(1, torch.cuda.device_count())


@dataclass(frozen=True)
class Batching:
    """How one update is made: ``max_tokens`` per batch on each of ``devices`` devices, summed
    over ``update_freq`` batches (fairseq's --max-tokens, world size, --update-freq)."""

    max_tokens: int
    devices: int
    update_freq: int

    @property
    def tokens_per_update(self) -> int:
        return self.max_tokens * self.devices * self.update_freq

    def describe(self) -> str:
        plural = "s" if self.devices != 1 else ""
        return (f"{self.tokens_per_update} tokens per update (--max-tokens {self.max_tokens} x "
                f"{self.devices} device{plural} x --update-freq {self.update_freq})")


def plan_batching(tokens_per_update: int, device_max_tokens: int, devices: int, recipe: str = "") -> Batching:
    """The batching that reaches ``tokens_per_update`` exactly on ``devices`` devices: each
    device's share is split into the fewest batches of at most ``device_max_tokens`` (the
    recipe's --max-tokens, what one device holds) that divide it evenly; a share split into
    more than twice the fewest batches possible counts as unreachable. Raises
    :class:`NormplugError` naming the values and device counts that work."""
    where = f"recipe {recipe!r}: " if recipe else ""

    def reachable(count: int) -> bool:
        if tokens_per_update % count:
            return False
        share = tokens_per_update // count
        fewest = math.ceil(share / device_max_tokens)
        return any(share % freq == 0 for freq in range(fewest, 2 * fewest + 1))

    if devices < 1 or not reachable(devices):
        working = [str(count) for count in range(1, 65) if reachable(count)][:8]
        why = (f"{tokens_per_update} is not a multiple of {devices}" if devices >= 1 and tokens_per_update % devices
               else f"no split of {tokens_per_update // max(devices, 1)} tokens per device into batches of at most "
                    f"{device_max_tokens}")
        raise NormplugError(f"{where}{tokens_per_update} tokens per update cannot be reached exactly on {devices} "
                            f"device(s) ({why}); device counts that work: {', '.join(working) or 'none'}")
    share = tokens_per_update // devices
    freq = math.ceil(share / device_max_tokens)
    while share % freq:
        freq += 1
    return Batching(max_tokens=share // freq, devices=devices, update_freq=freq)


def batching_flags(recipe: Recipe, flags: List[str], devices: int) -> List[str]:
    """``--max-tokens``/``--update-freq`` reaching the recipe's ``tokens_per_update`` on
    ``devices`` devices, given the recipe's (and row's) ``flags`` (none for a recipe without it)."""
    if recipe.tokens_per_update is None:
        return []
    given = last_flag_value(flags, "--max-tokens")
    if given is None:
        raise NormplugError(f"recipe {recipe.name!r} has tokens_per_update but no --max-tokens (the most "
                            f"tokens one device holds); add it to its 'train' flags")
    batching = plan_batching(recipe.tokens_per_update, int(given), devices, recipe.name)
    return ["--max-tokens", str(batching.max_tokens), "--update-freq", str(batching.update_freq)]


def command_batching(command: List[str], planned_devices: Optional[int] = None) -> Batching:
    """The batching a fairseq-train command trains with (the last occurrence of each flag)."""
    max_tokens = last_flag_value(command, "--max-tokens")
    if max_tokens is None:
        raise NormplugError("the training command has no --max-tokens, so its tokens per update are unknown")
    return Batching(max_tokens=int(max_tokens), devices=world_size(command, planned_devices),
                    update_freq=int(last_flag_value(command, "--update-freq") or 1))
