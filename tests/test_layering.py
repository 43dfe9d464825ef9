"""The package's layering, defined here once: a part of ``fairseq_normplug`` imports only
from itself and from parts of lower layers (any import statement, also one inside a
function). A new top-level module or sub-package must be placed in :data:`LAYERS`."""
import ast
import os

from conftest import REPO

#: lowest first. A part is a sub-package (``models``) or a top-level module (``errors``);
#: ``__init__`` is the package itself, which registers everything with fairseq.
LAYERS = (
    # standard library, torch and fairseq only: errors, set-up checks, atomic file writing,
    # fairseq's argument parsing, the plugin's paths, the toy corpus, the one seam that starts commands
    {"errors", "install_plan", "atomic_files", "cli", "fairseq_parsing", "resources", "command_start"},
    # the one check of every numeric flag (finite, in its declared range); the toy corpus (written
    # through atomic_files); the one reader of command-line flag lists (argparse's rules); the one
    # builder of fairseq command lines (program, data, --user-dir)
    {"numeric_flags", "synthetic_corpus", "flag_lists", "fairseq_commands"},
    {"checkpoint_compat"},        # checkpoint loading: safe, a refusal one line (a NormplugError)
    {"fairseq_patches"},          # the three fairseq wrappers (one passes checkpoint_compat's refusals on)
    {"extensions", "hub"},        # loading a researcher's own norms and placements; hub files beside checkpoints
    {"modules", "prepare"},       # norm layers; corpus preparation
    {"optim"},                    # lr schedules; the param group of --norm-weight-decay
    {"models"},                   # architecture, config, placements, which parameters are norm parameters
    {"tasks", "criterions"},
    {"checkpoint_safety"},        # checkpoints of a finished or killed run
    {"experiments"},              # runner, tables, figures
    {"diagnostics", "bench"},
    {"export"},                   # fairseq-normplug-ct2: loads a checkpoint as diagnostics does, writes CTranslate2
    {"__init__"},
    {"hydra_train"},              # fairseq-normplug-hydra-train: imports the plugin, then fairseq's hydra entry
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str:
    """``fairseq_normplug.models.placements.base`` -> ``models``; the package -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(tree: ast.AST):
    """The modules ``tree`` imports (``from fairseq_normplug import a`` gives
    ``fairseq_normplug.a``); a relative import gives ``.`` (the package uses none)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                yield "."
            elif node.module == "fairseq_normplug":
                yield from (f"fairseq_normplug.{alias.name}" for alias in node.names)
            else:
                yield node.module


def layering_violations(package_dir: str):
    """``(file, what)`` for every import of a part of the same or a higher layer, every
    relative import and every part missing from LAYERS, in the package at ``package_dir``."""
    found = []
    top = os.path.dirname(package_dir)
    for root, _, files in sorted(os.walk(package_dir)):
        for name in sorted(f for f in files if f.endswith(".py")):
            relative = os.path.relpath(os.path.join(root, name), top).replace(os.sep, "/")
            module = relative[: -len(".py")].replace("/", ".").replace(".__init__", "")
            source = part_of(module)
            if source not in RANK:
                found.append((relative, f"{source} is not in LAYERS"))
                continue
            with open(os.path.join(root, name), encoding="utf-8") as f:
                tree = ast.parse(f.read(), relative)
            for target in imported_modules(tree):
                if target == ".":
                    found.append((relative, "a relative import"))
                elif (target.startswith("fairseq_normplug.") and part_of(target) != source
                      and RANK.get(part_of(target), len(LAYERS)) >= RANK[source]):
                    found.append((relative, target))
    return found


def test_no_import_runs_upwards():
    assert layering_violations(os.path.join(REPO, "fairseq_normplug")) == []


def test_the_check_reports_upward_imports(tmp_path):
    """The two upward imports of issue 34 (optim/ importing models/, a low module importing
    experiments/), an import between parts of one layer, and an unplaced part."""
    package = tmp_path / "fairseq_normplug"
    for folder in ("optim", "modules", "models"):
        (package / folder).mkdir(parents=True)
    (package / "__init__.py").write_text("from fairseq_normplug import models, errors\n")
    (package / "models" / "__init__.py").write_text("from fairseq_normplug.optim import norm_weight_decay\n")
    (package / "optim" / "norm_weight_decay.py").write_text(
        "def rule():\n    from fairseq_normplug.models.norm_parameters import norm_parameter_names\n")
    (package / "checkpoint_safety.py").write_text("from fairseq_normplug.experiments.tables import atomic_output\n")
    (package / "modules" / "x.py").write_text("import fairseq_normplug.prepare.text\nfrom . import y\n")
    (package / "newpart.py").write_text("")
    assert sorted(layering_violations(str(package))) == [
        ("fairseq_normplug/checkpoint_safety.py", "fairseq_normplug.experiments.tables"),
        ("fairseq_normplug/modules/x.py", "a relative import"),
        ("fairseq_normplug/modules/x.py", "fairseq_normplug.prepare.text"),
        ("fairseq_normplug/newpart.py", "newpart is not in LAYERS"),
        ("fairseq_normplug/optim/norm_weight_decay.py", "fairseq_normplug.models.norm_parameters"),
    ]
