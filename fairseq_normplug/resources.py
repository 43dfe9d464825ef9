"""Where the project's files are: the configs (``configs/``: experiments, recipes, data
settings) and the folders commands write by default (``data/``, ``runs/``, ``results/``).

* From a git checkout (``pip install -e .``, or ``--user-dir fairseq_normplug``): the
  repository's top-level ``configs/``, the source of truth, and the repository's folders.
* From an installed wheel: the copy of ``configs/`` the build put into the package
  (``fairseq_normplug/configs``, see setup.py), and folders in the current directory.
"""
import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
CHECKOUT_DIR = os.path.dirname(PACKAGE_DIR)
#: imported from a checkout of the repository (not from an installed wheel)
FROM_CHECKOUT = (os.path.isfile(os.path.join(CHECKOUT_DIR, "pyproject.toml"))
                 and os.path.isdir(os.path.join(CHECKOUT_DIR, "configs")))
CONFIG_DIR = os.path.join(CHECKOUT_DIR if FROM_CHECKOUT else PACKAGE_DIR, "configs")
#: where data/, runs/ and results/ go by default: the checkout, else the current directory
PROJECT_DIR = CHECKOUT_DIR if FROM_CHECKOUT else os.getcwd()
