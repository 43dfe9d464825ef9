"""Test-only start-up shortcut: on the PYTHONPATH of the test session and of every command a
test runs (``tests/conftest.py``), scikit-learn and scipy.stats are imported on first use
instead of at start-up.

fairseq imports every criterion at start-up, and ``criterions/sentence_prediction.py`` imports
scikit-learn and scipy.stats for its metrics: about 1.5 s of the ~5 s a fairseq process needs
to start (``python -X importtime -c "import fairseq_cli.train"``), in each of the hundreds of
processes the suite runs. The plugin never uses them. Here those modules are placeholders: the
names fairseq imports from them (``DEFERRED``) are functions that import the real module on
their first call, and anything else (another attribute, a submodule import) swaps the real
modules in at once. A process that really uses them gets the real ones.
"""
import importlib
import importlib.machinery
import os
import sys
import types

#: module -> the names fairseq imports from it at start-up
DEFERRED = {
    "sklearn": ("metrics",),
    "sklearn.metrics": ("f1_score", "matthews_corrcoef"),
    "scipy": ("stats",),
    "scipy.stats": ("pearsonr", "spearmanr"),
}


def _real(name: str) -> types.ModuleType:
    """Drop every placeholder and import the real ``name``."""
    for stubbed in DEFERRED:
        if isinstance(sys.modules.get(stubbed), _Placeholder):
            del sys.modules[stubbed]
    return importlib.import_module(name)


class _Placeholder(types.ModuleType):
    def __getattr__(self, attr):
        if attr in ("__file__", "__cached__"):  # inspect.getmodule scans every module's file
            raise AttributeError(attr)
        child = f"{self.__name__}.{attr}"
        if attr in DEFERRED.get(self.__name__, ()):
            if child in DEFERRED:
                return sys.modules.get(child) or _real(child)
            return _deferred(self.__name__, attr)
        return getattr(_real(self.__name__), attr)


def _deferred(module: str, attr: str):
    def call(*args, **kwargs):
        return getattr(_real(module), attr)(*args, **kwargs)
    call.__name__ = call.__qualname__ = attr
    return call


class _RealOnSubmoduleImport:
    """Meta-path hook: importing any other submodule of a placeholder package (``import
    scipy.linalg``) first swaps the real packages in, then lets the normal finders work."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        top = name.partition(".")[0]
        if name not in DEFERRED and isinstance(sys.modules.get(top), _Placeholder):
            _real(top)
        return None


def _install() -> None:
    sys.meta_path.insert(0, _RealOnSubmoduleImport)
    for name in DEFERRED:
        parent, _, child = name.rpartition(".")
        search = sys.modules[parent].__path__ if parent else None
        spec = importlib.machinery.PathFinder.find_spec(name, search)
        if spec is None:  # not installed: nothing to defer
            return
        module = _Placeholder(name)
        module.__spec__ = spec  # importlib.util.find_spec(name) answers as for the real one
        module.__path__ = spec.submodule_search_locations  # a package: `from X import sub` works
        sys.modules[name] = module


if not any(name in sys.modules for name in DEFERRED):
    _install()

# the test session's fork server, when it runs (tests/fast_start/_normplug_zygote.py)
if os.environ.get("NORMPLUG_TEST_ZYGOTE"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when run by path (kill hook)
    try:
        import _normplug_zygote
    finally:
        del sys.path[0]
    _normplug_zygote.start_through_zygote()
