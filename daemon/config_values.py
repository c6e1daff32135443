"""A configuration value parsed where it enters: sizes, rates, durations, listen addresses (and the one
line a failed bind gives), URLs, names, devices, plans, choices; and ``ConfigError``.

Each parser takes the TOML value or the environment variable's text and returns the typed value, or
raises ValueError saying what was expected; daemon/config.py prefixes the key.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import math
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any

from patchswarm.daemon.run_rules import check_run_id


class ConfigError(Exception):
    """A configuration problem, always naming the offending key."""


class ListenError(ConfigError):
    """A listen address that could not be bound (in use, not on this host, privileged port)."""


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1e3,
    "KB": 1e3,
    "M": 1e6,
    "MB": 1e6,
    "G": 1e9,
    "GB": 1e9,
    "T": 1e12,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


_DURATION = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def _finite(x: float | int, v: Any) -> float:
    """``float(x)``, refusing what has no finite value (inf, nan, integers past the float range)."""
    try:
        f = float(x)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"expected a finite value, got {v!r}")
    return f


def parse_size(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError("expected a size")
    if isinstance(v, int | float):
        if v < 0:
            raise ValueError(f"expected a finite, non-negative size, got {v!r}")
        return _finite(v, v)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(v))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"expected a size like '100MB' or '16GiB', got {v!r}")
    return _finite(float(m.group(1)) * _UNITS[m.group(2).upper()], v)


def parse_rate(v: Any) -> float:
    """Bytes per second; 0 means unlimited."""
    try:
        r = parse_size(v)
    except ValueError:
        raise ValueError(f"expected a rate like '100MB' (bytes per second), got {v!r}") from None
    return math.inf if r == 0 else r


def parse_duration(v: Any) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0:
        return _finite(v, v)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)\s*", str(v))
    if not m:
        raise ValueError(f"expected a duration like '500ms', '5s' or '2m', got {v!r}")
    return _finite(float(m.group(1)) * _DURATION[m.group(2)], v)


def parse_positive_duration(v: Any) -> float:
    d = parse_duration(v)
    if d <= 0:
        raise ValueError(f"expected a duration above zero, got {v!r}")
    return d


def split_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); IPv6 hosts in brackets (``[::1]:7000``); an empty host is 0.0.0.0."""
    host, sep, port = listen.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT (IPv6 as [::1]:PORT), got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1])), int(port)
        except ValueError:
            raise ValueError(f"expected an IPv6 address in brackets, got {listen!r}") from None
    if ":" in host:
        raise ValueError(f"an IPv6 host goes in brackets ([{host}]:{port}), got {listen!r}")
    if not re.fullmatch(r"[A-Za-z0-9._-]{0,253}", host):
        raise ValueError(f"expected HOST:PORT with a host name or address, got {listen!r}")
    return host or "0.0.0.0", int(port)


def url_host(host: str) -> str:
    """A host as it goes into a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


_BIND_REASONS = {
    errno.EADDRINUSE: "address already in use",
    errno.EADDRNOTAVAIL: "no such address on this host",
    errno.EACCES: "permission denied (a port below 1024 needs privileges)",
}


@contextlib.contextmanager
def bind_errors(key: str, value: str) -> Iterator[None]:
    """Turn a failure to bind ``value`` into one line naming the config key, e.g.
    ``node.listen = [::1]:7000: address already in use``."""
    try:
        yield
    except socket.gaierror as e:
        raise ListenError(f"{key} = {value}: unknown host ({e.strerror})") from None
    except OSError as e:
        reason = _BIND_REASONS.get(e.errno or 0) or (e.strerror or str(e)).lower()
        raise ListenError(f"{key} = {value}: {reason}") from None


def parse_listen(v: Any) -> str:
    split_listen(parse_str(v))
    return str(v).strip()


def _shown(v: Any) -> str:
    """A rejected value as its error line shows it: a URL's credentials never (swarm/client_errors.py)."""
    from patchswarm.swarm.client_errors import shown_url

    return repr(shown_url(v)) if isinstance(v, str) else repr(v)


def parse_url(v: Any) -> str:
    if not isinstance(v, str) or not re.match(r"^https?://[^/\s]+", v):
        raise ValueError(f"expected an http(s) URL, got {_shown(v)}")
    return v.rstrip("/")


def parse_board_url(v: Any) -> str:
    """A board URL: http(s) (a seed, nginx, the store's HTTPS endpoint, a CDN) or an object store's
    s3:// gs:// az:// URL, read through its SDK with the provider's environment credentials."""
    from patchswarm.swarm.board_store import parse_store_url

    if isinstance(v, str) and parse_store_url(v) is not None:
        return v.rstrip("/")
    try:
        return parse_url(v)
    except ValueError:
        raise ValueError(f"expected an http(s), s3://, gs:// or az:// URL, got {_shown(v)}") from None


def _url_list(v: Any, parse: Callable[[Any], str]) -> list[str]:
    if isinstance(v, str):
        v = [x for x in v.split(",") if x.strip()]
    if not isinstance(v, list):
        raise ValueError("expected a list of URLs")
    return [parse(x.strip() if isinstance(x, str) else x) for x in v]


def parse_urls(v: Any) -> list[str]:
    return _url_list(v, parse_url)


def parse_board_urls(v: Any) -> list[str]:
    return _url_list(v, parse_board_url)


def parse_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def parse_name(v: Any) -> str:
    s = parse_str(v)
    if not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", s):
        raise ValueError(f"expected letters, digits and . _ : - (at most 128), got {v!r}")
    return s


def parse_run_id(v: Any) -> str:
    return check_run_id(parse_str(v), "run id")


def parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes", "on"):
        return True
    if str(v).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {v!r}")


def parse_int(v: Any) -> int:
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, str) and v.strip().isdigit())):
        raise ValueError(f"expected a whole number, got {v!r}")
    return int(v)


def count_in(lo: int, hi: int) -> Callable[[Any], int]:
    """A whole number in [lo, hi]."""

    def parse(v: Any) -> int:
        n = parse_int(v)
        if not lo <= n <= hi:
            raise ValueError(f"expected a whole number from {lo} to {hi}, got {n}")
        return n

    return parse


def parse_device(v: Any) -> str:
    s = parse_str(v).strip()
    if s in ("", "cpu") or re.fullmatch(r"cuda:[0-9]{1,3}", s) or re.fullmatch(r"(?i)GPU-[0-9a-f-]{8,64}", s):
        return s
    raise ValueError(f"expected '', 'cpu', 'cuda:N' or 'GPU-<uuid>', got {v!r}")


def parse_devices(v: Any) -> list[str]:
    if isinstance(v, str):
        v = [x for x in v.split(",") if x.strip()]
    if not isinstance(v, list) or len(v) > 256:
        raise ValueError("expected a list of devices (cuda:N or GPU-<uuid>), at most 256")
    return [parse_device(x) for x in v]


def parse_routes(v: Any) -> list[str]:
    """Paths the sidecar forwards besides its allow list (daemon/sidecar_routes.py checks each)."""
    from patchswarm.daemon.sidecar_routes import check_routes

    if isinstance(v, str):
        v = [x.strip() for x in v.split(",") if x.strip()]
    if not isinstance(v, list):
        raise ValueError("expected a list of paths like '/v1/messages'")
    return list(check_routes(v))


def parse_plan(v: Any) -> str:
    """none, auto, a built-in family name, or a plan file's path (a value with a /; read at start-up)."""
    from patchswarm.protocol.layout_builtin import DENSE, MOE

    s = parse_str(v).strip()
    known = ["none", "auto", *sorted(DENSE | MOE)]
    if s in known or ("/" in s and len(s) <= 4096 and "\0" not in s):
        return s
    raise ValueError(f"expected one of {', '.join(known)} or a plan file's path (with a /), got {str(v)[:200]!r}")


def choice(*options: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {v!r}")
        return str(v)

    return parse
