"""Reading an operator's YAML and text files, and the field checks that cluster files
(config.py) and node files (node_config.py) share.

Every error is a ConfigError naming the file, the field and the problem (the CLI turns it into
one line and exit code 2).
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

from meshllm.errors import ConfigError, number_hint
from meshllm.mesh.fields import NODE_PORT_MAX

MAX_YAML_BYTES = 16 << 20  # any configuration or key file: a cluster of thousands of nodes is well under 1 MiB


def read_text_file(path: str | Path, src: str, fld: str, what: str = "a YAML file", secret: bool = False) -> str:
    """An operator's small text file (a cluster or node file, a key file); ConfigError(src, fld, ...) for a
    missing path, a folder, a device or pipe (/dev/zero would be read for ever), one too large, not UTF-8;
    and with `secret` (a secret key, an API token), one that its group or others may read, as ssh
    refuses a private key file that others can read."""
    p = Path(path)
    name = "" if src == str(path) else f"{str(path)!r}: "
    if not str(path):
        raise ConfigError(src, fld, f"must be the path of {what}, got ''")
    if not p.exists():
        raise ConfigError(src, fld, f"{name}no such file")
    if not p.is_file():
        raise ConfigError(src, fld, f"{name}is a directory, not {what}" if p.is_dir() else f"{name}not a regular file")
    try:
        if (size := p.stat().st_size) > MAX_YAML_BYTES:
            raise ConfigError(src, fld, f"{name}{size} bytes: too large for {what} (at most {MAX_YAML_BYTES >> 20} MiB)")
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(src, fld, f"{name}not a text file (UTF-8): is it the right path?") from None
    except OSError as e:
        raise ConfigError(src, fld, f"{name}cannot be read: {e.strerror or e}") from None
    if secret and (mode := p.stat().st_mode) & 0o077:
        raise ConfigError(src, fld, f"{name}{what} that others may read (mode {mode & 0o777:04o}): make it "
                                    f"private to its owner: chmod 600 {path}")
    return text


@functools.cache
def _strict_loader():
    """yaml's SafeLoader, but a key given twice in one mapping is an error: YAML takes the last
    silently (a second `nodes:` list would drop the first list's nodes from the plan)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # an unhashable key: construct_mapping says so itself
                        continue
                    seen.setdefault(key, key_node.start_mark.line + 1)
                    if first is not None:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"duplicate key {key!r} (first on line {first}): YAML would keep only "
                            "the last", key_node.start_mark)
            return super().construct_mapping(node, deep)

    return StrictLoader


def read_yaml(path: str | Path) -> dict:
    import yaml

    text = read_text_file(path, str(path), "(file)")
    try:
        data = yaml.load(text, Loader=_strict_loader())  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        problem = getattr(e, "problem", None) or getattr(e, "reason", None) or str(e)  # (a ReaderError: `reason`)
        raise ConfigError(str(path), where, f"invalid YAML: {' '.join(str(problem).split())}") from None
    except RecursionError:  # `[[[[...]]]]` a thousand deep: the parser's recursion, not this program's fault
        raise ConfigError(str(path), "(file)", "invalid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "(top level)", "expected a mapping")
    return data


def split_hostport(s: Any, src: str, fld: str, max_port: int = NODE_PORT_MAX) -> tuple[str, int]:
    """HOST:PORT -> (host, port), else ConfigError. A node's address by default (its PUB socket
    takes PORT + 1, so 65535 is no node's port); an HTTP listener passes max_port=65535."""
    if not isinstance(s, str) or ":" not in s:
        raise ConfigError(src, fld, f"expected HOST:PORT, got {s!r}")
    host, _, port = s.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) <= max_port:
        why = "" if max_port == 65535 else " (a node's PUB socket takes PORT + 1)"
        raise ConfigError(src, fld, f"expected HOST:PORT with a port in 1..{max_port}{why}, got {s!r}")
    if ":" in host and max_port != 65535:  # the HTTP API may listen on IPv6; the mesh's sockets do not
        raise ConfigError(src, fld, f"a node's address is an IPv4 address or a host name (the mesh's "
                                    f"ZeroMQ sockets are IPv4 only), got {s!r}")
    if ":" not in host and host != "*" and not _HOST_NAME.fullmatch(host):  # failed only at bind: exit 1
        raise ConfigError(src, fld, f"{host!r:.60} is not an IPv4 address or a host name")
    return host, int(port)


# a host name (RFC 1123 labels, and "_", which resolvers take: compose service names) or a dotted
# IPv4 address, which is one too
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def given(d: dict, key: str, empty: Any) -> Any:
    """d[key], or `empty` where it is absent or null (a bare `key:` in YAML). Any other value is
    the caller's to check: `speculation: off` (false in YAML 1.1), 0 or "" are not "absent"."""
    v = d.get(key)
    return empty if v is None else v


def check_keys(d: Any, allowed: set[str], required: set[str], src: str, prefix: str) -> dict:
    if not isinstance(d, dict):
        hint = " (speculation: {mode: off} turns it off)" if prefix == "speculation." and d is False else ""
        raise ConfigError(src, prefix.rstrip(".") or "(top level)", f"expected a mapping, got {type(d).__name__}{hint}")
    for k in d:
        if k not in allowed:
            raise ConfigError(src, f"{prefix}{k}", f"unknown key (allowed: {', '.join(sorted(allowed))})")
    for k in sorted(required):
        if k not in d:
            raise ConfigError(src, f"{prefix}{k}", "missing required field")
    return d


def number(v: Any, src: str, fld: str, *, lo: float = 0.0, integer: bool = False, strict: bool = False,
         hi: float | None = None) -> float:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)  # not .nan / .inf
    if isinstance(v, bool) or not ok or v < lo or (strict and v == lo) or (hi is not None and v > hi):
        kind = "an integer" if integer else "a finite number"
        if hi is not None:
            bounds = f"[{lo:g}, {int(hi) if integer else f'{hi:g}'}]"  # (2**31, not 2.14748e+09)
            raise ConfigError(src, fld, f"must be {kind} in {bounds}, got {v!r}{number_hint(v)}")
        raise ConfigError(src, fld, f"must be {kind} {'>' if strict else '>='} {lo:g}, got {v!r}{number_hint(v)}")
    return v


def choice(v: Any, choices: tuple[str, ...], src: str, fld: str) -> str:
    if v not in choices:
        raise ConfigError(src, fld, f"must be one of {', '.join(choices)}, got {v!r}")
    return v


NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def node_id(v: Any, src: str, fld: str) -> str:
    """A node id: 1 to 63 letters, digits, '_', '-' or '.', from a letter or digit. It names the
    node's files in an emulated cluster, its mDNS service and a `NODE_ID KEY` line of
    authorized_keys, and `ID@HOST:PORT` names it in seeds and --status."""
    if not isinstance(v, str) or not NODE_ID.fullmatch(v):
        raise ConfigError(src, fld, f"must be 1 to 63 letters, digits, '_', '-' or '.' (from a letter or digit), "
                          f"got {v!r:.80}")
    return v


def zone_name(v: Any, src: str, fld: str) -> str:
    """A zone name, by the node ids' rule: it travels in every message's header and is printed in
    logs, plans and the `--png` picture (a newline in it would forge a log line)."""
    return node_id(v, src, fld)
