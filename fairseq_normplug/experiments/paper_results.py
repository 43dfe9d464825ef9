"""The published numbers of configs/paper_results.json and how a result row is matched to one:
each reference names its source, metric and configuration; a row's configuration is read from
its ``config`` string (:func:`config_string`: its flags and schedule) by :data:`CONFIGURATION_KEYS`,
and only a reference of the same configuration and metric is shown beside it."""
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from fairseq_normplug.errors import NormplugError
from fairseq_normplug.experiments.json_config import check_keys, read_json_config
from fairseq_normplug.flag_lists import parse_flag_list
from fairseq_normplug.experiments.portable_paths import default_roots, expanded, to_portable
from fairseq_normplug.models.norm_types_per_layer import spec_label
from fairseq_normplug.models.placements import placement_label
from fairseq_normplug.models.resolved_config import resolve_flags
from fairseq_normplug.resources import CONFIG_DIR

PAPER_RESULTS_PATH = os.path.join(CONFIG_DIR, "paper_results.json")
#: every metric a published number or a table's cells can be in: {name: what it is}
METRICS = {
    "tokenized_bleu": "tokenized BLEU (multi-bleu.perl on the tokenized test set)",
    "compound_split_bleu": "compound-split BLEU (tokenized BLEU after fairseq's compound_split_bleu.sh, "
                           "as fairseq's WMT'14 en-de recipe reports it)",
    "multi_bleu_detok": "detokenized BLEU (multi-bleu-detok.perl: mteval-v13a tokenization inside, no smoothing)",
    "sacrebleu": "sacreBLEU (detokenized text, sacreBLEU's tokenizer, see its signature)",
    "chrf": "chrF (sacreBLEU's chrF2: character 6-grams, beta 2, on sacreBLEU's detokenized text, see its signature)",
    "chrf++": "chrF++ (sacreBLEU's chrF2++: chrF2 plus word 1-2-grams, on sacreBLEU's detokenized text)",
}
#: metrics a table's cells (and so its significance test) can use (bleu.METRIC_SCORERS): computed
#: from the tokenized lines, or, chrF and chrF++, from the detokenized lines sacreBLEU scores
CELL_METRICS = ("tokenized_bleu", "compound_split_bleu", "multi_bleu_detok", "chrf", "chrf++")
DEFAULT_METRIC = "tokenized_bleu"
#: what identifies a configuration: {attribute: how it is read from a row's flags}
CONFIGURATION_KEYS = {
    "placement": "the registered placement's label (postnorm, prenorm, sandwich, ...) with +modifier per "
                 "modifier flag (prenorm+normformer)",
    "norm": "--norm-type, or a registered shorthand (--scalenorm / --rmsnorm / --dyt); layernorm by default; "
            "with --norm-types-per-layer SPEC followed by +per-layer(SPEC)",
    "fixnorm": "true with --fixnorm",
    "qknorm": "true with --qknorm",
    "init": "--weight-init, or smallinit with --smallinit; fairseq by default",
    "residual_scale": "--residual-scale; none by default",
    "layers": "\"E/D\" from --encoder-layers / --decoder-layers; null when neither is given (the recipe's)",
    "schedule": "the row's schedule name (configs/schedules.json)",
    "stop_lr": "--stop-lr; 5e-05 (the plugin's default, the paper's) when not given",
}
DEFAULT_STOP_LR = 5e-5
REFERENCE_KEYS = {"source", "metric", "configuration", "description", "recipe", "note", "bleu"}
TABLE_KEYS = {"title", "pairs", "metric", "references"}


@dataclass(frozen=True)
class Reference:
    """A published number set: ``bleu`` {pair: number} in ``metric`` (a key of :data:`METRICS`),
    produced by ``configuration`` (attributes of :data:`CONFIGURATION_KEYS`; only those given are
    compared), described in words by ``description``, from ``source``."""
    table: str
    source: str
    metric: str
    configuration: Dict[str, object]
    bleu: Dict[str, float]
    description: str = ""
    recipe: str = ""
    note: str = ""

    def matches(self, configuration: Optional[dict]) -> bool:
        """Whether a row of ``configuration`` (:func:`row_configuration`) is this configuration."""
        return configuration is not None and all(configuration.get(key) == value
                                                 for key, value in self.configuration.items())


def _check_metric(metric, where: str, choices: Sequence[str] = tuple(METRICS)) -> str:
    if metric not in choices:
        raise NormplugError(f"{where}: unknown metric {metric!r}; choose from {', '.join(choices)}")
    return metric


def _load_reference(table: str, spec: dict, data, where: str) -> Reference:
    if isinstance(data, Reference):
        return data
    check_keys(data, REFERENCE_KEYS, where)
    for key in ("source", "metric", "configuration", "bleu"):
        if key not in data:
            raise NormplugError(f"{where}: missing key {key!r} (every published number records its "
                                f"source, metric, configuration and numbers)")
    check_keys(data["configuration"], CONFIGURATION_KEYS, f"{where}: configuration")
    if not data["configuration"]:
        raise NormplugError(f"{where}: empty configuration; give some of {', '.join(CONFIGURATION_KEYS)}")
    check_keys(data["bleu"], spec.get("pairs", []), f"{where}: bleu (pairs of the table)")
    for pair, value in data["bleu"].items():
        if value is not None and not isinstance(value, (int, float)):
            raise NormplugError(f"{where}: bleu {pair}={value!r} is not a number (null: unknown)")
    configuration = dict(data["configuration"])
    if configuration.get("stop_lr") is not None:
        configuration["stop_lr"] = float(configuration["stop_lr"])
    return Reference(table=table, source=data["source"], metric=_check_metric(data["metric"], where),
                     configuration=configuration,
                     bleu={pair: float(v) for pair, v in data["bleu"].items() if v is not None},
                     description=data.get("description", ""), recipe=data.get("recipe", ""),
                     note=data.get("note", ""))


def load_paper_results(path: str = PAPER_RESULTS_PATH) -> dict:
    """The published numbers: ``{"tables": {table: {"title": str, "pairs": [pair, ...],
    "metric": the cells' metric (default tokenized_bleu), "references": [Reference, ...]}}}``,
    every reference checked (its metric, its configuration's attributes, its pairs)."""
    if not os.path.isfile(path):
        raise NormplugError(f"no such paper-results file: {path}")
    return checked_paper_results(read_json_config(path), path)


def checked_paper_results(paper: dict, where: str = "paper results") -> dict:
    """``paper`` (the contents of a configs/paper_results.json) checked, its references made
    :class:`Reference` objects (in place; checking it again changes nothing)."""
    for table, spec in paper.get("tables", {}).items():
        where_table = f"{where}: {table}"
        check_keys(spec, TABLE_KEYS, where_table)
        spec["metric"] = _check_metric(spec.get("metric", DEFAULT_METRIC), f"{where_table}: cell metric",
                                       CELL_METRICS)
        spec["references"] = [_load_reference(table, spec, data, f"{where_table}: reference {index + 1}")
                              for index, data in enumerate(spec.get("references", []))]
    return paper


def with_cell_metric(paper: dict, table: str, metric: Optional[str]) -> dict:
    """``paper`` with ``table``'s cells in ``metric`` (one of :data:`CELL_METRICS`; reproduce.sh
    --metric), a copy; ``paper`` itself when ``metric`` is None."""
    if metric is None:
        return paper
    _check_metric(metric, "--metric", CELL_METRICS)
    tables = dict(paper.get("tables", {}))
    tables[table] = {**tables.get(table, {}), "metric": metric}
    return {**paper, "tables": tables}


def cell_metric(paper: dict, table: str) -> str:
    """The metric of ``table``'s cells: its ``metric`` in configs/paper_results.json, else tokenized BLEU."""
    return paper.get("tables", {}).get(table, {}).get("metric", DEFAULT_METRIC)


def references(paper: dict, table: str) -> List[Reference]:
    return list(paper.get("tables", {}).get(table, {}).get("references", []))


def config_string(flags: Sequence[str], schedule: str) -> str:
    """A result row's ``config``: the row's model (and train) flags, then ``schedule=NAME``; a
    path in portable form (``$CHECKOUT/examples/...``: experiments/portable_paths.py)."""
    return " ".join([*to_portable(flags, default_roots()), f"schedule={schedule}"])


def row_configuration(config: Optional[str]) -> Optional[Dict[str, object]]:
    """The attributes of :data:`CONFIGURATION_KEYS` of a :func:`config_string`; None for a
    ``config`` without ``schedule=`` (not written by the runner: it matches no published number)
    or with flags fairseq-train refuses (no run trained them). Norm type, placement, modifiers,
    FixNorm, QKNorm, init and residual scale are read from the row's resolved configuration
    (``models/resolved_config.py`` :func:`resolve_flags`), as its model is built."""
    tokens = (config or "").split()
    schedules = [token.split("=", 1)[1] for token in tokens if token.startswith("schedule=")]
    if not schedules:
        return None
    flag_tokens = expanded([token for token in tokens if not token.startswith("schedule=")], default_roots())
    try:
        resolved = resolve_flags(flag_tokens)
    except NormplugError:  # contradicting or unknown flags: no run trained them, no published number matches
        return None
    flags = {name: values[0] if values else True for name, values in parse_flag_list(flag_tokens).items()}
    norm = resolved.norm_type
    if resolved.norm_types_per_layer:
        norm = f"{norm}+{spec_label(resolved.norm_types_per_layer)}"
    encoder, decoder = flags.get("--encoder-layers"), flags.get("--decoder-layers")
    try:
        stop_lr = float(flags.get("--stop-lr", DEFAULT_STOP_LR))
    except ValueError:
        stop_lr = None
    return {"placement": placement_label(resolved.placement, resolved.modifiers), "norm": norm,
            "fixnorm": resolved.fixnorm, "qknorm": resolved.qknorm, "init": resolved.weight_init,
            "residual_scale": resolved.residual_scale,
            "layers": None if encoder is None and decoder is None else f"{encoder or '?'}/{decoder or '?'}",
            "schedule": schedules[-1], "stop_lr": stop_lr}


def matching_reference(paper: dict, table: str, config: Optional[str], pair: str) -> Optional[Reference]:
    """The published number to show beside a row of ``config`` on ``pair``: a reference of
    ``table`` with a number for ``pair``, in the table's cell metric, whose configuration is the
    row's. None when there is none (a number of another configuration or metric is never shown
    beside a row)."""
    configuration = row_configuration(config)
    metric = cell_metric(paper, table)
    for reference in references(paper, table):
        if pair in reference.bleu and reference.metric == metric and reference.matches(configuration):
            return reference
    return None


def paper_bleu(paper: dict, table: str, config: Optional[str], pair: str) -> Optional[float]:
    """The published number beside a row of ``config`` (:func:`config_string`) on ``pair``,
    None where there is none (see :func:`matching_reference`)."""
    reference = matching_reference(paper, table, config, pair)
    return None if reference is None else reference.bleu[pair]
