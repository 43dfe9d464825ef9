"""Experiment configs (``configs/``) loaded and validated before anything runs.

* ``configs/experiments/<table>.json``: one file per paper table (``table2`` ... ``table7``)
  plus ``demo``: ``title``, ``recipe``, ``pairs`` and ``rows``; each row has a ``name``,
  ``model`` flags, a ``schedule`` name, optionally ``baseline`` (the row it is compared to),
  ``train`` (extra fairseq-train flags) and ``paper`` (a note).
* ``configs/recipes.json``: how rows are trained and evaluated, each recipe written as a
  ``base`` recipe plus its differences (``train`` flags merged over the base's, ``unset``
  flags removed, ``decoding`` keys merged): arch, fairseq-train flags, the ``decoding`` spec
  shared by dev BLEU and the test set, fairseq-generate batching flags, ``pairs`` (the recipe
  replaces its base for these pairs in every table), ``tokens_per_update`` (the runner sets
  --update-freq to reach it); ``warmup_scale`` and ``lr_lambda_scale`` shrink the schedules'
  warmup length and lambda for short CPU runs of small models, and ``lr_scale`` multiplies
  their constant ``--lr`` (NoWarmup's 3e-4) for a model of another size.
* ``configs/schedules.json``: the paper's learning-rate schedules as flags.
* ``configs/data.json``: where each language pair's prepared data lives.

A typo anywhere (unknown key, unknown schedule/recipe/baseline, duplicate row) is a
:class:`NormplugError` naming the file, the place and the valid choices. So is a file that is
not a UTF-8 JSON object, a number that is not finite (``NaN``, ``Infinity``, ``1e999``) or out
of its range, two rows whose names map to one run folder, and a pair name that is not ``xx-yy``.
"""
import os
import re
import unicodedata
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Union

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.flag_lists import split_flags
from fairseq_normplug.resources import CONFIG_DIR, PROJECT_DIR
from fairseq_normplug.experiments.depths import check_depths, expand_rows
from fairseq_normplug.experiments.json_config import check_keys, read_json_config

EXPERIMENT_DIR = os.path.join(CONFIG_DIR, "experiments")

TABLE_KEYS = {"title", "recipe", "pairs", "rows", "normplug_modules", "depths", "recipe_layers", "reuse_runs_from"}
ROW_KEYS = {"name", "model", "schedule", "baseline", "train", "paper", "normplug_modules"}
RECIPE_KEYS = {"description", "base", "pairs", "arch", "train", "unset", "decoding", "generate",
               "tokens_per_update", "warmup_scale", "lr_lambda_scale", "lr_scale"}
#: keys of a recipe's ``decoding`` spec: fairseq generation options, plus the task's GNMT alpha,
#: the authors' search (``gnmt_search``) and fairseq's batch-wide length cap (``batch_length_cap``)
DECODING_KEYS = {"beam", "gnmt_alpha", "gnmt_search", "batch_length_cap", "lenpen", "max_len_a", "max_len_b"}
#: what a recipe does not inherit from its base
NOT_INHERITED = ("description", "pairs", "base", "unset")
SCHEDULE_KEYS = {"description", "flags", "warmup"}
#: a language pair: two language codes of 2-3 lower-case letters (also a safe folder name)
PAIR_PATTERN = re.compile(r"[a-z]{2,3}-[a-z]{2,3}")


def slug(name: str) -> str:
    """A row's run-folder name: its name lower-cased, every run of other characters one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


#: Unicode categories a row name cannot hold: control characters (newline, tab, ...) and the
#: line and paragraph separators; a row name is one line of text (a row of results.md)
NOT_IN_ROW_NAMES = ("Cc", "Zl", "Zp")


def check_row_name(name, where: str) -> str:
    """``name`` if it can name a row: a string with letters or digits (it names the run folder),
    all on one line (no character of :data:`NOT_IN_ROW_NAMES`); else a one-line NormplugError
    prefixed with ``where``."""
    if not isinstance(name, str) or not slug(name):
        raise NormplugError(f"{where}: row name {name!r} needs letters or digits (it names the run folder)")
    bad = [char for char in name if unicodedata.category(char) in NOT_IN_ROW_NAMES]
    if bad:
        raise NormplugError(f"{where}: row name {name!r} holds the control character {bad[0]!r}; a row name "
                            f"is one line of text (it is a row of results.md)")
    return name


def check_pair(pair, where: Optional[str] = None, example: str = "gl-en") -> str:
    """``pair`` if it is ``xx-yy`` (two language codes, see :data:`PAIR_PATTERN`), else a
    NormplugError (prefixed with ``where``): a pair names folders, so ``../x`` or ``a/b`` must
    never pass."""
    if not isinstance(pair, str) or not PAIR_PATTERN.fullmatch(pair):
        raise NormplugError(f"{where + ': ' if where else ''}bad language pair {pair!r}; write it as SRC-TGT, "
                            f"e.g. {example} (language codes of 2-3 lower-case letters)")
    return pair


@dataclass(frozen=True)
class Row:
    name: str
    model: List[str]
    schedule: str
    baseline: Optional[str] = None
    train: List[str] = field(default_factory=list)
    paper: Optional[str] = None
    #: in a table trained at several depths (experiments/depths.py): the row of the file it
    #: expands, and its layers per stack
    design: Optional[str] = None
    layers: Optional[int] = None


@dataclass(frozen=True)
class Recipe:
    name: str
    arch: str
    train: List[str]
    generate: List[str]
    decoding: Dict[str, Union[int, float]] = field(default_factory=dict)
    description: str = ""
    base: Optional[str] = None
    pairs: List[str] = field(default_factory=list)
    tokens_per_update: Optional[int] = None
    warmup_scale: float = 1.0
    lr_lambda_scale: float = 1.0
    lr_scale: float = 1.0


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
    recipes: Dict[str, Recipe] = field(default_factory=dict)
    #: the layers per stack each row is trained at (experiments/depths.py); empty: the recipe's
    depths: List[int] = field(default_factory=list)
    #: the runs folder of a table whose finished runs of the same rows and commands are reused
    reuse_runs_from: Optional[str] = None

    def recipe_for(self, pair: str) -> Recipe:
        """The table's recipe, or the recipe that replaces it for ``pair`` (e.g. en-vi rows of a
        ``ted`` table train with ``iwslt15``: a recipe whose ``base`` is the table's recipe and
        whose ``pairs`` name ``pair``)."""
        for recipe in self.recipes.values():
            if recipe.base == self.recipe.name and pair in recipe.pairs:
                return recipe
        return self.recipe

    def row(self, name: str) -> Row:
        for row in self.rows:
            if row.name == name:
                return row
        raise NormplugError(f"{self.name}: no row named {name!r}; rows: {', '.join(r.name for r in self.rows)}")


def _check_flags(value, where: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NormplugError(f"{where}: expected a list of strings (command-line flags), got {value!r}")
    return list(value)


def extension_flags(modules: Sequence[str], base: str = ".") -> List[str]:
    """``--normplug-modules`` for a row's extensions (docs/extending.md): a path (relative ones
    from ``base``) made absolute, so the row's commands find it from any folder; a module name
    as it is. No flag without extensions."""
    if not modules:
        return []
    items = []
    for item in modules:
        path = os.path.join(base, item)
        items.append(os.path.abspath(path) if os.path.exists(path) else item)
    return ["--normplug-modules", ",".join(items)]


def _named_entries(path: str) -> Dict[str, dict]:
    return {name: value for name, value in read_json_config(path).items() if not name.startswith("_")}


def _check_flag_map(value, where: str) -> Dict[str, Union[str, bool]]:
    """{"--flag": "value" or true} of a recipe's ``train``/``generate``."""
    if not isinstance(value, dict):
        raise NormplugError(f"{where}: expected an object {{\"--flag\": \"value\" or true}}, got {value!r}")
    for flag, flag_value in value.items():
        if not flag.startswith("--") or not (isinstance(flag_value, str) or flag_value is True):
            raise NormplugError(f"{where}: bad flag {flag!r}: {flag_value!r}; write \"--flag\": \"value\" "
                                f"(or true for a flag without value)")
    return dict(value)


def flag_list(flags: Dict[str, Union[str, bool]]) -> List[str]:
    """{"--a": "1", "--b": true} -> ["--a", "1", "--b"]."""
    return [item for flag, value in flags.items() for item in ([flag] if value is True else [flag, value])]


def _merged_recipe(name: str, raw: Dict[str, dict], path: str, seen: tuple = ()) -> dict:
    """The recipe ``name`` with its base's values filled in (bases resolved recursively)."""
    where = f"{path}: recipe {name!r}"
    data = raw[name]
    check_keys(data, RECIPE_KEYS, where)
    for key in ("train", "generate"):
        if key in data:
            _check_flag_map(data[key], f"{where}: {key!r}")
    if "decoding" in data:
        check_keys(data["decoding"], DECODING_KEYS, f"{where}: 'decoding'")
    if "base" not in data:
        for key in ("arch", "train", "decoding", "generate"):
            if key not in data:
                raise NormplugError(f"{where}: missing key {key!r} (or a 'base' recipe to take it from)")
        if "unset" in data:
            raise NormplugError(f"{where}: 'unset' needs a 'base' recipe")
        return dict(data)
    base = data["base"]
    if base not in raw:
        raise NormplugError(f"{where}: unknown base {base!r}; choose from {', '.join(sorted(raw))}")
    if base in seen + (name,):
        raise NormplugError(f"{where}: base recipes form a cycle ({' -> '.join(seen + (name, base))})")
    merged = {key: value for key, value in _merged_recipe(base, raw, path, seen + (name,)).items()
              if key not in NOT_INHERITED}
    for key, value in data.items():
        if key in ("train", "generate", "decoding"):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    unset = data.get("unset", [])
    if not isinstance(unset, list) or not all(isinstance(flag, str) for flag in unset):
        raise NormplugError(f"{where}: 'unset' must list flags of the base's 'train', got {unset!r}")
    for flag in unset:
        if flag not in merged["train"]:
            raise NormplugError(f"{where}: cannot unset {flag!r}: not a 'train' flag of base {base!r}")
        del merged["train"][flag]
    merged["decoding"] = {key: value for key, value in merged["decoding"].items() if value is not None}
    return merged


def _recipe(name: str, data: dict, where: str) -> Recipe:
    decoding = data["decoding"]
    if "gnmt_alpha" in decoding and "lenpen" in decoding:
        raise NormplugError(f"{where}: 'decoding' has both gnmt_alpha and lenpen; set the other to null")
    if not isinstance(decoding.get("beam"), int) or decoding["beam"] < 1:
        raise NormplugError(f"{where}: 'decoding' needs an integer beam >= 1, got {decoding.get('beam')!r}")
    for key in ("gnmt_search", "batch_length_cap"):
        if decoding.get(key) is not None and not isinstance(decoding[key], bool):
            raise NormplugError(f"{where}: 'decoding' {key} must be true, false or null, got {decoding[key]!r}")
    for key, least, kind in (("gnmt_alpha", 0, (int, float)), ("lenpen", 0, (int, float)),
                             ("max_len_a", 0, (int, float)), ("max_len_b", 0, int)):
        value = decoding.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind) or value < least):
            kind_name = "an integer" if kind is int else "a number"
            raise NormplugError(f"{where}: 'decoding' {key} must be {kind_name} >= {least}, got {value!r}")
    if decoding.get("gnmt_search") and "gnmt_alpha" not in decoding:
        raise NormplugError(f"{where}: 'decoding' has gnmt_search but no gnmt_alpha (the authors' search "
                            f"ranks by GNMT's normalised score); give gnmt_alpha or set gnmt_search to null")
    pairs = data.get("pairs", [])
    if not isinstance(pairs, list):
        raise NormplugError(f"{where}: 'pairs' must list language pairs like 'en-vi', got {pairs!r}")
    for pair in pairs:
        check_pair(pair, f"{where}: 'pairs'")
    recipe = Recipe(name=name, arch=data["arch"], train=flag_list(data["train"]),
                    generate=flag_list(data["generate"]), decoding=dict(decoding),
                    description=data.get("description", ""), base=data.get("base"), pairs=list(pairs),
                    tokens_per_update=data.get("tokens_per_update"),
                    warmup_scale=float(data.get("warmup_scale", 1.0)),
                    lr_lambda_scale=float(data.get("lr_lambda_scale", 1.0)),
                    lr_scale=float(data.get("lr_scale", 1.0)))
    for key in ("warmup_scale", "lr_lambda_scale"):
        if not 0 < getattr(recipe, key) <= 1:
            raise NormplugError(f"{where}: {key} must be in (0, 1], got {getattr(recipe, key)}")
    if not 0 < recipe.lr_scale <= 10:
        raise NormplugError(f"{where}: lr_scale must be in (0, 10], got {recipe.lr_scale}")
    if recipe.tokens_per_update is not None and (not isinstance(recipe.tokens_per_update, int)
                                                 or recipe.tokens_per_update < 1):
        raise NormplugError(f"{where}: tokens_per_update must be a positive integer, got {recipe.tokens_per_update!r}")
    return recipe


def load_recipes(config_dir: str = CONFIG_DIR) -> Dict[str, Recipe]:
    """Every recipe of ``recipes.json``, bases resolved (see the module docstring)."""
    path = os.path.join(config_dir, "recipes.json")
    raw = _named_entries(path)
    recipes = {name: _recipe(name, _merged_recipe(name, raw, path), f"{path}: recipe {name!r}") for name in raw}
    claimed: Dict[tuple, str] = {}
    for recipe in recipes.values():
        for pair in recipe.pairs:
            if (recipe.base, pair) in claimed:
                raise NormplugError(f"{path}: recipes {claimed[(recipe.base, pair)]!r} and {recipe.name!r} "
                                    f"both replace {recipe.base!r} for {pair}")
            claimed[(recipe.base, pair)] = recipe.name
    return recipes


def load_schedules(config_dir: str = CONFIG_DIR) -> Dict[str, Schedule]:
    path = os.path.join(config_dir, "schedules.json")
    schedules = {}
    for name, data in _named_entries(path).items():
        where = f"{path}: schedule {name!r}"
        check_keys(data, SCHEDULE_KEYS, where, required=("flags", "warmup"))
        if isinstance(data["warmup"], bool) or not isinstance(data["warmup"], int) or data["warmup"] < 0:
            raise NormplugError(f"{where}: 'warmup' must be an integer >= 0, got {data['warmup']!r}")
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
    data = read_json_config(path)
    check_keys(data, TABLE_KEYS, path, required=("recipe", "pairs", "rows"))
    recipes, schedules = load_recipes(config_dir), load_schedules(config_dir)
    if data["recipe"] not in recipes:
        raise NormplugError(f"{path}: unknown recipe {data['recipe']!r}; choose from {', '.join(recipes)}")
    if not isinstance(data["rows"], list) or not data["rows"]:
        raise NormplugError(f"{path}: 'rows' must be a non-empty list of rows")
    rows, names, folders = [], set(), {}
    table_modules = _check_flags(data.get("normplug_modules", []), f"{path}: normplug_modules")
    for index, row_data in enumerate(data["rows"]):
        where = f"{path}: row {index + 1}"
        check_keys(row_data, ROW_KEYS, where, required=("name", "model", "schedule"))
        modules = table_modules + _check_flags(row_data.get("normplug_modules", []), f"{where}: normplug_modules")
        row = Row(name=row_data["name"],
                  model=_check_flags(row_data["model"], where) + extension_flags(modules, PROJECT_DIR),
                  schedule=row_data["schedule"], baseline=row_data.get("baseline"),
                  train=_check_flags(row_data.get("train", []), where), paper=row_data.get("paper"))
        check_row_name(row.name, where)
        if row.name in names:
            raise NormplugError(f"{where}: duplicate row name {row.name!r}")
        if slug(row.name) in folders:
            raise NormplugError(f"{where}: rows {folders[slug(row.name)]!r} and {row.name!r} map to one run folder "
                                f"({slug(row.name)!r}); rename one")
        folders[slug(row.name)] = row.name
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
    if not isinstance(pairs, list) or not pairs:
        raise NormplugError(f"{path}: 'pairs' must list language pairs like 'gl-en', got {pairs!r}")
    for pair in pairs:
        check_pair(pair, f"{path}: 'pairs'")
    depths = []
    if "depths" in data or "recipe_layers" in data:
        depths = check_depths(data.get("depths"), data.get("recipe_layers"), path)
        rows = expand_rows(rows, depths, data["recipe_layers"])
    reuse = data.get("reuse_runs_from")
    if reuse is not None and (not isinstance(reuse, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", reuse)):
        raise NormplugError(f"{path}: 'reuse_runs_from' must name a table's runs folder, e.g. \"beyond.cpu_short\", "
                            f"got {reuse!r}")
    return Table(name=name, title=data.get("title", name), recipe=recipes[data["recipe"]],
                 pairs=list(pairs), rows=rows, schedules=schedules, recipes=recipes, depths=depths,
                 reuse_runs_from=reuse)


def under_recipe(table: Table, recipe: str) -> Table:
    """``table``'s rows trained with another recipe (``reproduce.sh beyond de-en --recipe
    cpu_short``: the beyond rows at CPU scale). The table is renamed ``TABLE.RECIPE``, so its
    runs and results never mix with the table's own."""
    if recipe not in table.recipes:
        raise NormplugError(f"unknown recipe {recipe!r}; choose from {', '.join(table.recipes)}")
    return replace(table, name=f"{table.name}.{recipe}", recipe=table.recipes[recipe],
                   title=f"{table.title} (recipe {recipe})")


def baseline_row(table: Table) -> Row:
    """The row the table compares the others with: the one most rows name as ``baseline``
    (the first row when none does)."""
    named = [row.baseline for row in table.rows if row.baseline]
    return table.row(max(named, key=named.count)) if named else table.rows[0]


def with_added_rows(table: Table, specs: Sequence[str], modules: Sequence[str] = (),
                    schedule: Optional[str] = None) -> Table:
    """``table`` plus a researcher's rows, ``--add-row "NAME=FLAGS"`` each (FLAGS split as a shell
    does): trained with the table's recipe and seeds, with ``schedule`` (default: the baseline
    row's) and compared with the baseline row (:func:`baseline_row`), so the table's kept runs are
    reused and only the new rows train. ``modules`` (``--normplug-modules``: the extensions that
    define the rows' norms or placements) are given to each new row as absolute paths."""
    baseline = baseline_row(table)
    schedule = schedule or baseline.schedule
    if schedule not in table.schedules:
        raise NormplugError(f"unknown --add-row-schedule {schedule!r}; choose from {', '.join(table.schedules)}")
    extensions = extension_flags(modules)
    rows, names = list(table.rows), {row.name for row in table.rows}
    folders = {slug(row.name): row.name for row in table.rows}
    for spec in specs:
        name, equals, flags = spec.partition("=")
        name = name.strip()
        if not equals or not name:
            raise NormplugError(f"--add-row {spec!r}: write it as \"NAME=FLAGS\", e.g. "
                                f"\"PreNorm + MyNorm=--prenorm --norm-type mynorm\"")
        if name in names:
            raise NormplugError(f"--add-row {name!r}: the table {table.name} already has a row of that name; "
                                f"choose another")
        if not slug(name):
            raise NormplugError(f"--add-row {name!r}: its name needs letters or digits (it names the run folder)")
        check_row_name(name, "--add-row")  # one line of text
        if slug(name) in folders:
            raise NormplugError(f"--add-row {name!r} and the row {folders[slug(name)]!r} of {table.name} map to one "
                                f"run folder ({slug(name)!r}): one run's result would be reported for both; "
                                f"rename the added row")
        folders[slug(name)] = name
        try:
            model = split_flags(flags)
        except ValueError as error:
            raise NormplugError(f"--add-row {name!r}: its flags do not parse as a shell line ({error})") from None
        names.add(name)
        rows.append(Row(name=name, model=model + extensions, schedule=schedule, baseline=baseline.name))
    return replace(table, rows=rows)


def load_data_locations(config_dir: str = CONFIG_DIR) -> Dict[str, str]:
    """{pair: prepared data folder (holding bin/ and ref/)}, relative paths under the repo."""
    path = os.path.join(config_dir, "data.json")
    locations = {}
    for pair, folder in _named_entries(path).items():
        check_pair(pair, path)
        if not isinstance(folder, str) or not folder:
            raise NormplugError(f"{path}: {pair}: expected a folder name, got {folder!r}")
        locations[pair] = os.path.join(PROJECT_DIR, folder) if not os.path.isabs(folder) else folder
    return locations
