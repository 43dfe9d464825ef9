"""A shim over pyproject.toml, where the package is described. It adds what pyproject.toml
cannot say for every setuptools this package builds with:

* the licence, MIT: as an SPDX ``License-Expression`` with setuptools >= 77, as the older
  ``License`` field before (setuptools >= 77 needs Python >= 3.9, and deprecates the older
  form: a warning on every build);
* the repository's top-level ``configs/`` (experiments, recipes, data settings; the source of
  truth) copied into the built package as ``fairseq_normplug/configs``, so that an installed
  wheel runs the project's jobs (fairseq_normplug/resources.py finds either).
"""
import os
import shutil

import setuptools
from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "configs")
LICENSE_EXPRESSION_SINCE = (77, 0)


class BuildPyWithConfigs(build_py):
    """setuptools' build_py, plus configs/ as package data of fairseq_normplug (not in an
    editable install, which reads the checkout's configs/ directly)."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            target = os.path.join(self.build_lib, "fairseq_normplug", "configs")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(CONFIGS, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def licence_metadata() -> dict:
    version = tuple(int(part) for part in setuptools.__version__.split(".")[:2])
    return {"license_expression": "MIT"} if version >= LICENSE_EXPRESSION_SINCE else {"license": "MIT"}


setup(cmdclass={"build_py": BuildPyWithConfigs}, **licence_metadata())
