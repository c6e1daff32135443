"""Argument types of the ``patchswarm`` command line: every value is checked where it enters.

Each is an argparse ``type=``: it returns the value or raises ArgumentTypeError saying why, so a bad
value exits with status 2 and one line naming the argument before anything is read or written.  The
rules are the readers' own, imported when a value is checked (``--help`` loads nothing heavy): a
writer never produces a patch, board or certificate that ``apply``, ``pull`` or a daemon refuses.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)

# What gossip (protocol/wire.py), the journal and the local API carry: a signed 64-bit integer.
MAX_VERSION = (1 << 63) - 1
# A certificate outliving its root key by a century is a mistake, and times past it overflow
# the calendar a reader prints them in.
MAX_CERT_DAYS = 36_525.0
# Zone and region labels travel in every gossip frame.
MAX_LABEL = 128


def bounded(convert: Callable[[str], N], what: str, low: N, high: N) -> Callable[[str], N]:
    """An argparse type: ``convert`` the text, refusing it (with why) outside ``low..high`` (NaN too)."""

    def parse(text: str) -> N:
        try:
            value = convert(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not low <= value <= high:  # False for NaN
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    return parse


count = bounded(int, "a whole number", 0, 1024)
copies = bounded(int, "a whole number", 0, 1 << 20)
fanout = bounded(int, "a whole number", 0, 64)
seconds = bounded(float, "a number of seconds", 0.0, 3600.0)
anchor_every = bounded(int, "a whole number", 1, 1 << 20)
version = bounded(int, "a version number", 1, MAX_VERSION)
base_version = bounded(int, "a version number", 0, MAX_VERSION - 1)


def run_id(text: str) -> str:
    """A run id both the board (a directory name) and a daemon's config (``swarm.run_id``) accept."""
    from patchswarm.daemon.run_rules import check_run_id

    try:
        return check_run_id(text, "run id")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def node_name(text: str) -> str:
    """A node id, by the rule of a daemon's ``node.name``."""
    from patchswarm.daemon.config_values import parse_name

    try:
        return parse_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a node name: {e}") from None


def label(text: str) -> str:
    """A zone or region: short, printable (empty is allowed: no zone)."""
    if len(text) > MAX_LABEL or not text.isprintable():
        raise argparse.ArgumentTypeError(f"expected at most {MAX_LABEL} printable characters, got {text!r}")
    return text


def chunk_size(text: str) -> int:
    """A chunk size a manifest may carry (protocol/chunks.py's bounds)."""
    from patchswarm.protocol.chunks import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE

    return bounded(int, "a whole number of bytes", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)(text)


def zstd_level(text: str) -> int:
    """A zstd level whose frames decoders accept: higher levels ask for a window past MAX_WINDOW."""
    import zstandard

    from patchswarm.protocol.streams import MAX_WINDOW

    def fits(level: int) -> bool:
        return bool(1 << zstandard.ZstdCompressionParameters.from_level(level).window_log <= MAX_WINDOW)

    top = max(lv for lv in range(1, zstandard.MAX_COMPRESSION_LEVEL + 1) if fits(lv))
    return bounded(int, "a zstd level", 1, top)(text)


def days(text: str) -> float:
    """A certificate's validity in days: positive, finite, at most MAX_CERT_DAYS."""
    value = bounded(float, "a number of days", 0.0, MAX_CERT_DAYS)(text)
    if value * 86_400_000 < 1:
        raise argparse.ArgumentTypeError(f"{value} days is less than a millisecond")
    return value


def rate(text: str) -> float:
    """Bytes per second ('100MB', '1GiB'), by the rule of the config's ``swarm.upload_rate``; 0 = unlimited."""
    from patchswarm.daemon.config_values import parse_rate

    try:
        return parse_rate(text)
    except ValueError as e:
        why = str(e)
    try:  # also a plain number in any float notation ('1e9'), by the same rule
        return parse_rate(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(why) from None


def url(text: str) -> str:
    """An http(s) URL, by the rule of the config's URL keys."""
    from patchswarm.daemon.config_values import parse_url
    from patchswarm.swarm.client_errors import shown_url

    if any(not c.isprintable() or c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected an http(s) URL, got {shown_url(text)!r}")
    try:
        return parse_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def board_url(text: str) -> str:
    """A board URL to poll: http(s), or an object store's s3:// gs:// az:// (``swarm.seed_urls``)."""
    from patchswarm.daemon.config_values import parse_board_url
    from patchswarm.swarm.client_errors import shown_url

    if any(not c.isprintable() or c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected a board URL, got {shown_url(text)!r}")
    try:
        return parse_board_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def listen(text: str) -> str:
    """HOST:PORT, [IPV6]:PORT or :PORT (all interfaces); the text itself, for daemon.config_values.split_listen."""
    host, sep, port = text.rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 0..65535, got {text!r}")
    if host.startswith("["):
        try:
            if not host.endswith("]"):
                raise ValueError(host)
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an IPv6 address: {host!r}") from None
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"write an IPv6 address in brackets, [ADDR]:PORT, got {text!r}")
    elif host and not _is_host(host):
        raise argparse.ArgumentTypeError(f"not a host name or IPv4 address: {host!r}")
    return text


def _is_host(host: str) -> bool:
    labels = host.removesuffix(".").split(".")
    if all(p.isdigit() for p in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return False
        return True
    return len(host) <= 253 and all(_HOST_LABEL.fullmatch(p) for p in labels)


workers = bounded(int, "a whole number", 1, 1024)


def ray_address(text: str) -> str:
    """Where ``simulate --ray`` finds its cluster: ``local`` (a Ray instance started for the study), ``auto``
    (the one ``ray start`` runs on this machine), or its head's HOST:PORT, optionally as ray://HOST:PORT."""
    if text in ("local", "auto"):
        return text
    hostport = text.removeprefix("ray://")
    if not hostport.rpartition(":")[0]:
        raise argparse.ArgumentTypeError(f"expected local, auto or HOST:PORT, got {text!r}")
    listen(hostport)
    return text


def path(text: str) -> str:
    """A file name: not empty, no NUL (whether the file is usable is checked when it is read)."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def output_path(text: str) -> str:
    """A file to create: a name that is not a directory, in a directory that exists."""
    if path(text).endswith("/") or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file name, got {text!r}")
    parent = os.path.dirname(text) or "."
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"no directory {parent!r} to write {os.path.basename(text)!r} in")
    return text


def board(text: str) -> str:
    """A board to write: an object store URL (s3://, gs://, az://), a file:// URL or a directory (or a
    name where one will be created).  Credentials come from the environment, never from here."""
    from patchswarm.swarm.board_store import local_path, parse_store_url
    from patchswarm.swarm.client_errors import shown_url

    path(text)
    if text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"{shown_url(text)!r}: an HTTP board is read-only; write to its store (s3://, gs://, az://) or a directory"
        )
    try:
        if parse_store_url(text) is not None:
            return text
        local = local_path(text) or text
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if os.path.exists(local) and not os.path.isdir(local):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return text


def board_source(text: str) -> str:
    """A board to read: an http(s) URL, a store URL, a file:// URL or a directory."""
    from patchswarm.swarm.board_store import local_path, parse_store_url

    path(text)
    try:
        parse_store_url(text)
        local_path(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def output_target(text: str) -> str:
    """A file or a checkpoint directory to create or replace (a directory when it exists or ends in '/'),
    in a directory that exists."""
    parent = os.path.dirname(path(text).rstrip("/")) or "."
    if not text.rstrip("/"):
        raise argparse.ArgumentTypeError(f"expected a file or directory name, got {text!r}")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"no directory {parent!r} to write {os.path.basename(text.rstrip('/'))!r} in")
    return text


# --served-format spellings on the command line -> ServedFormat names (daemon/served_format.py)
SERVED_FORMATS = {"bf16": "bf16", "fp16": "fp16", "fp8-e4m3": "fp8_e4m3", "as-is": "as_is"}
MAX_FP8_BLOCK = 4096


def served_format(text: str) -> str:
    """A served format: bf16, fp16, fp8-e4m3 or as-is (the ServedFormat name it stands for)."""
    name = SERVED_FORMATS.get(text) or SERVED_FORMATS.get(text.replace("_", "-"))
    if name is None:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(SERVED_FORMATS)}, got {text!r}")
    return name


def payload_format(text: str) -> int:
    """A patch payload format this build writes (protocol/payload_formats.py PAYLOAD_FORMATS: 1 or 2)."""
    from patchswarm.protocol.payload_formats import PAYLOAD_FORMATS

    if text.strip() not in {str(f) for f in PAYLOAD_FORMATS}:
        raise argparse.ArgumentTypeError(f"expected {' or '.join(map(str, PAYLOAD_FORMATS))}, got {text!r}")
    return int(text)


PAYLOAD_FORMAT_HELP = (
    "2 (default): float positions coded under base-value contexts where that is smaller (about 0.75x the "
    "bytes, slower to apply; docs/format.md section 2a); 1: every build reads it, for fleets that still "
    "have hosts of builds before manifest format 2 (they refuse format-2 patches and stay where they are)"
)


def fp8_block(text: str) -> int:
    """fp8 scale granularity: a square block size (128 as DeepSeek-V3 checkpoints), or per-tensor (0)."""
    if text == "per-tensor":
        return 0
    return bounded(int, "a block size or per-tensor", 1, MAX_FP8_BLOCK)(text)


# ---------------------------------------------------------------- engine (patchswarm engine ...)

max_tokens_limit = bounded(int, "a whole number of tokens", 1, 1 << 20)
prefix_cache_entries = bounded(int, "a whole number of entries", 0, 4096)
fence_wait = bounded(float, "a number of seconds", 0.001, 3600.0)


def device(text: str) -> str:
    """A torch device the engine computes on: cpu, cuda or cuda:N."""
    if not re.fullmatch(r"cpu|cuda(:[0-9]{1,3})?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def checkpoint_dir(text: str) -> str:
    """A checkpoint directory with a config.json (the engine also reads its tokenizer files)."""
    if not os.path.isdir(path(text)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json")
    return text
