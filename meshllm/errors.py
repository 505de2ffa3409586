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


def number_hint(v: object) -> str:
    """For a config number that YAML read as text: why (YAML 1.1 takes `1e30` for a string; `1.0e30`
    is a number), else ""."""
    if isinstance(v, str) and "e" in v.lower() and "." not in v:  # not "4" (quoted) nor "inf"
        try:
            float(v)
        except ValueError:
            return ""
        return " (YAML reads a number such as 1e30 without a dot as text: write 1.0e30)"
    return ""
