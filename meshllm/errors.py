"""Exceptions for bad external input. The CLI maps InputError to exit code 2."""


class InputError(ValueError):
    """Bad user input (arguments, YAML, a model path): one actionable line, no traceback."""


class ConfigError(InputError):
    """A YAML config file (cluster, node, device) is invalid. The message names file and field."""

    def __init__(self, source: str, field: str, problem: str):
        self.source, self.field, self.problem = source, field, problem
        super().__init__(f"{source}: {field}: {problem}")


class ModelFileError(InputError):
    """A model path is missing, not a model file, or not a Llama-family model."""


class LoadCancelled(Exception):
    """A load of weights stopped between two tensors because its `stop()` said so (a node's
    newer plan came while it loaded its part of an older one)."""


def number_hint(v: object) -> str:
    """For a config number that YAML read as text: why, and the spelling YAML 1.1 reads as a number
    (its floats need a dot and a signed exponent: `1e30`, `1.0e30` and `1.0e6` are all strings,
    `1.0e+30` is a number), else ""."""
    if not isinstance(v, str):
        return ""
    try:
        x = float(v)
    except ValueError:
        return ""
    if x != x or x in (float("inf"), float("-inf")):
        return ""  # 'nan', 'inf': not a finite number either way
    text = v.strip()
    mantissa, e, exponent = text.lower().partition("e")
    if not e:
        return f" (quoted, a number is text in YAML: write {text} without quotes)"
    if "." not in mantissa:
        mantissa += ".0"
    if exponent[:1] not in ("+", "-"):
        exponent = "+" + exponent
    return f" (YAML 1.1 reads a number with an exponent as text unless it has a dot and a signed exponent: " \
           f"write {mantissa}e{exponent})"
