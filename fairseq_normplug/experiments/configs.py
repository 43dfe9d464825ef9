"""Experiment configs (``configs/``) loaded and validated before anything runs.

* ``configs/experiments/<table>.json``: one file per paper table (``table2`` ... ``table7``)
  plus ``demo``: ``title``, ``recipe``, ``pairs`` and ``rows``; each row has a ``name``,
  ``model`` flags, a ``schedule`` name, optionally ``baseline`` (the row it is compared to),
  ``train`` (extra fairseq-train flags) and ``paper`` (a note).
* ``configs/recipes.json``: how rows are trained and evaluated (arch, fairseq-train and
  fairseq-generate flags; ``warmup_scale`` and ``lr_lambda_scale`` shrink the schedules'
  warmup length and lambda for short CPU runs of small models).
* ``configs/schedules.json``: the paper's learning-rate schedules as flags.
* ``configs/data.json``: where each language pair's prepared data lives.

A typo anywhere (unknown key, unknown schedule/recipe/baseline, duplicate row) is a
:class:`NormplugError` naming the file, the place and the valid choices.
"""
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from fairseq_normplug.errors import NormplugError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(REPO, "configs")
EXPERIMENT_DIR = os.path.join(CONFIG_DIR, "experiments")

TABLE_KEYS = {"title", "recipe", "pairs", "rows"}
ROW_KEYS = {"name", "model", "schedule", "baseline", "train", "paper"}
RECIPE_KEYS = {"description", "arch", "train", "generate", "warmup_scale", "lr_lambda_scale"}
SCHEDULE_KEYS = {"description", "flags", "warmup"}


@dataclass(frozen=True)
class Row:
    name: str
    model: List[str]
    schedule: str
    baseline: Optional[str] = None
    train: List[str] = field(default_factory=list)
    paper: Optional[str] = None


@dataclass(frozen=True)
class Recipe:
    name: str
    arch: str
    train: List[str]
    generate: List[str]
    description: str = ""
    warmup_scale: float = 1.0
    lr_lambda_scale: float = 1.0


@dataclass(frozen=True)
class Schedule:
    name: str
    flags: List[str]
    warmup: int
    description: str = ""


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    recipe: Recipe
    pairs: List[str]
    rows: List[Row]
    schedules: Dict[str, Schedule]

    def row(self, name: str) -> Row:
        for row in self.rows:
            if row.name == name:
                return row
        raise NormplugError(f"{self.name}: no row named {name!r}; rows: {', '.join(r.name for r in self.rows)}")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise NormplugError(f"config file not found: {path}") from None
    except json.JSONDecodeError as error:
        raise NormplugError(f"{path}: invalid JSON ({error})") from None


def _check_keys(data: dict, allowed: set, where: str, required=()) -> None:
    if not isinstance(data, dict):
        raise NormplugError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise NormplugError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(allowed))}")
    missing = [key for key in required if key not in data]
    if missing:
        raise NormplugError(f"{where}: missing key {missing[0]!r}")


def _check_flags(value, where: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NormplugError(f"{where}: expected a list of strings (command-line flags), got {value!r}")
    return list(value)


def _named_entries(path: str) -> Dict[str, dict]:
    return {name: value for name, value in _read_json(path).items() if not name.startswith("_")}


def load_recipes(config_dir: str = CONFIG_DIR) -> Dict[str, Recipe]:
    path = os.path.join(config_dir, "recipes.json")
    recipes = {}
    for name, data in _named_entries(path).items():
        where = f"{path}: recipe {name!r}"
        _check_keys(data, RECIPE_KEYS, where, required=("arch", "train", "generate"))
        recipes[name] = Recipe(name=name, arch=data["arch"], train=_check_flags(data["train"], where),
                               generate=_check_flags(data["generate"], where),
                               description=data.get("description", ""),
                               warmup_scale=float(data.get("warmup_scale", 1.0)),
                               lr_lambda_scale=float(data.get("lr_lambda_scale", 1.0)))
        for key in ("warmup_scale", "lr_lambda_scale"):
            if not 0 < getattr(recipes[name], key) <= 1:
                raise NormplugError(f"{where}: {key} must be in (0, 1], got {getattr(recipes[name], key)}")
    return recipes


def load_schedules(config_dir: str = CONFIG_DIR) -> Dict[str, Schedule]:
    path = os.path.join(config_dir, "schedules.json")
    schedules = {}
    for name, data in _named_entries(path).items():
        where = f"{path}: schedule {name!r}"
        _check_keys(data, SCHEDULE_KEYS, where, required=("flags", "warmup"))
        schedules[name] = Schedule(name=name, flags=_check_flags(data["flags"], where),
                                   warmup=int(data["warmup"]), description=data.get("description", ""))
    return schedules


def available_tables(config_dir: str = CONFIG_DIR) -> List[str]:
    folder = os.path.join(config_dir, "experiments")
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".json"))


def load_table(name: str, config_dir: str = CONFIG_DIR) -> Table:
    """Load and validate ``configs/experiments/<name>.json`` with its recipe and schedules."""
    tables = available_tables(config_dir)
    if name not in tables:
        raise NormplugError(f"unknown table {name!r}; choose from {', '.join(tables)}")
    path = os.path.join(config_dir, "experiments", f"{name}.json")
    data = _read_json(path)
    _check_keys(data, TABLE_KEYS, path, required=("recipe", "pairs", "rows"))
    recipes, schedules = load_recipes(config_dir), load_schedules(config_dir)
    if data["recipe"] not in recipes:
        raise NormplugError(f"{path}: unknown recipe {data['recipe']!r}; choose from {', '.join(recipes)}")
    rows, names = [], set()
    for index, row_data in enumerate(data["rows"]):
        where = f"{path}: row {index + 1}"
        _check_keys(row_data, ROW_KEYS, where, required=("name", "model", "schedule"))
        row = Row(name=row_data["name"], model=_check_flags(row_data["model"], where),
                  schedule=row_data["schedule"], baseline=row_data.get("baseline"),
                  train=_check_flags(row_data.get("train", []), where), paper=row_data.get("paper"))
        if row.name in names:
            raise NormplugError(f"{where}: duplicate row name {row.name!r}")
        if row.schedule not in schedules:
            raise NormplugError(f"{where} ({row.name}): unknown schedule {row.schedule!r}; "
                                f"choose from {', '.join(schedules)}")
        names.add(row.name)
        rows.append(row)
    for row in rows:
        if row.baseline is not None and row.baseline not in names:
            raise NormplugError(f"{path}: row {row.name!r} has unknown baseline {row.baseline!r}; "
                                f"rows: {', '.join(sorted(names))}")
    pairs = data["pairs"]
    if not pairs or not all(isinstance(p, str) and p.count("-") == 1 for p in pairs):
        raise NormplugError(f"{path}: 'pairs' must list language pairs like 'gl-en', got {pairs!r}")
    return Table(name=name, title=data.get("title", name), recipe=recipes[data["recipe"]],
                 pairs=list(pairs), rows=rows, schedules=schedules)


def load_data_locations(config_dir: str = CONFIG_DIR) -> Dict[str, str]:
    """{pair: prepared data folder (holding bin/ and ref/)}, relative paths under the repo."""
    path = os.path.join(config_dir, "data.json")
    return {pair: os.path.join(REPO, folder) if not os.path.isabs(folder) else folder
            for pair, folder in _named_entries(path).items()}
