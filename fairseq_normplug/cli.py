"""Small console helpers installed with the package."""
import os


def user_dir() -> str:
    """Absolute path of the plugin package, the value for fairseq's ``--user-dir``."""
    return os.path.dirname(os.path.abspath(__file__))


def print_user_dir() -> None:
    """``fairseq-normplug-path``: print the ``--user-dir`` value, e.g.
    ``fairseq-train --user-dir "$(fairseq-normplug-path)" ...``."""
    print(user_dir())
