"""The ``args`` namespaces that the plugin's argument resolution leaves, for a handful of flag
sets, as JSON (tests/fixtures/resolved_args/snapshot.json, written by today's code and compared by
tests/test_args_writer.py): ``python tests/resolved_args_snapshot.py`` rewrites the file."""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from model_helpers import parse_args  # noqa: E402

from fairseq_normplug.models.resolved_config import resolve  # noqa: E402

SNAPSHOT = os.path.join(HERE, "fixtures", "resolved_args", "snapshot.json")
ARCH = "transformer_normplug_tiny"
#: name -> the flags after ``--arch transformer_normplug_tiny``
FLAG_SETS = {
    "stock": [],
    "tears": ["--prenorm", "--fixnorm", "--scalenorm", "--smallinit"],
    "hyper_connections_2": ["--norm-placement", "hyper-connections", "--hc-streams", "2"],
    "mix": ["--norm-placement", "mix"],
    "qknorm": ["--qknorm"],
    "denseformer": ["--prenorm", "--denseformer"],
    "value_residual": ["--value-residual"],
    "deepnorm": ["--residual-scale", "deepnorm"],
    "fixnorm_untied": ["--fixnorm", "--arch", "transformer_normplug"],
    "bf16": ["--bf16"],
}
#: name -> a hand-made Namespace (an old checkpoint's args, another entry point), resolved once:
#: the fields filled in and their order
NAMESPACES = {
    "bare": {},
    "prenorm_fixnorm": {"prenorm": True, "fixnorm": True, "norm_type": "scalenorm"},
    "hyper_connections": {"norm_placement": "hyper-connections", "hc_manifold": True},
    "mixed_fairseq_prenorm": {"encoder_normalize_before": True},
}
#: name -> (norm type, values): ``norm_args``'s Namespace (norms built outside a model)
NORM_ARGS = {
    "layernorm": ("layernorm", {}),
    "dyt_alpha": ("dyt", {"dyt_alpha_init": 0.2}),
    "scalenorm": ("scalenorm", {}),
    "rmsnorm_zero_centered": ("rmsnorm", {"zero_centered_gamma": True}),
}
#: fields that name this machine (its GPU count) or this checkout, not the resolution
VOLATILE = ("data", "user_dir", "distributed_world_size", "distributed_num_procs", "nprocs_per_node")


def jsonable(value):
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def extension_fields():
    """The flags of norm types and layer designs registered from outside the package: another
    test may have loaded an extension into this process (they stay registered), and every parse
    then has its flags; they are not the package's resolution."""
    from fairseq_normplug.models.placements import registered_designs
    from fairseq_normplug.modules.norm_registry import NORM_TYPES

    norms = [norm.defaults for norm in NORM_TYPES.values() if not norm.source.startswith("fairseq_normplug.")]
    designs = [design.defaults for design in registered_designs()
               if not design.__module__.startswith("fairseq_normplug.")]
    return {dest for defaults in [*norms, *designs] for dest in defaults}


def parsed(name):
    """The flag set's args after fairseq-train's parsing (the presets resolve once) and after
    build_model's second resolution."""
    args = parse_args("DATA", ARCH, *FLAG_SETS[name])
    resolve(args)
    ignored = {*VOLATILE, *extension_fields()}
    return {key: jsonable(value) for key, value in vars(args).items() if key not in ignored}


def hand_made(name):
    """A hand-made Namespace after one resolution, as ordered (key, value) pairs."""
    args = argparse.Namespace(**NAMESPACES[name])
    resolve(args)
    ignored = extension_fields()
    return [[key, jsonable(value)] for key, value in vars(args).items() if key not in ignored]


def norm_args_fields(name):
    """``norm_args``'s Namespace for the case, as ordered (key, value) pairs."""
    from fairseq_normplug.modules.norm_registry import norm_args

    norm_type, values = NORM_ARGS[name]
    ignored = extension_fields()
    return [[key, jsonable(value)] for key, value in vars(norm_args(norm_type, **values)).items() if key not in ignored]


def snapshot():
    return {"parsed": {name: parsed(name) for name in FLAG_SETS},
            "hand_made": {name: hand_made(name) for name in NAMESPACES},
            "norm_args": {name: norm_args_fields(name) for name in NORM_ARGS}}


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else SNAPSHOT, "w", encoding="utf-8") as f:
        json.dump(snapshot(), f, indent=1, sort_keys=False)
        f.write("\n")
