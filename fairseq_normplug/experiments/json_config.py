"""Reading a JSON config file with its validation: a one-line :class:`NormplugError` naming the
file for a missing file, text that is not UTF-8 JSON, a number that is not finite (``NaN``,
``Infinity``, ``1e999``) or a top level that is not an object; and the check of an object's keys
against the valid ones, naming the place and the choices."""
import json
import math

from fairseq_normplug.errors import NormplugError


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows here (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not finite")
    return value


def read_json_config(path: str) -> dict:
    """The JSON object in ``path``, every number finite; a missing file, one that is not UTF-8
    JSON (``NaN`` and ``Infinity`` included), or JSON that is not an object is a one-line
    :class:`NormplugError` naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f, parse_constant=_no_constant, parse_float=_finite_float)
    except FileNotFoundError:
        raise NormplugError(f"config file not found: {path}") from None
    except UnicodeDecodeError as error:
        raise NormplugError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except ValueError as error:  # json.JSONDecodeError, and the two hooks' errors
        raise NormplugError(f"{path}: invalid JSON ({error})") from None
    if not isinstance(data, dict):
        raise NormplugError(f"{path}: expected a JSON object {{...}}, got {type(data).__name__}")
    return data


def check_keys(data: dict, allowed, where: str, required=()) -> None:
    """Refuse ``data`` unless it is an object whose keys are among ``allowed`` and include
    ``required``, in one line naming ``where`` (and the valid keys)."""
    if not isinstance(data, dict):
        raise NormplugError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise NormplugError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(allowed))}")
    missing = [key for key in required if key not in data]
    if missing:
        raise NormplugError(f"{where}: missing key {missing[0]!r}")
