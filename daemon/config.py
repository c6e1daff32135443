"""The rollout daemon's configuration: a TOML file, overridable by environment variables.

Every key is declared once in ``SCHEMA`` (daemon/config_schema.py) with its type, default and documentation
(docs/daemon.md is checked against it); the values' parsers are daemon/config_values.py's.  Any invalid
value raises ConfigError naming the key, e.g.
``swarm.upload_rate: expected a rate like '100MB' (bytes per second), got 'fast'``.
Environment overrides: ``PATCHSWARM_<SECTION>_<KEY>`` (upper case), e.g. ``PATCHSWARM_SWARM_UPLOAD_RATE=50MB``.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchswarm.daemon.config_schema import BY_PATH, SECTIONS
from patchswarm.daemon.config_schema import SCHEMA as SCHEMA
from patchswarm.daemon.config_schema import unknown_env as unknown_env
from patchswarm.daemon.config_values import ConfigError as ConfigError
from patchswarm.daemon.config_values import ListenError as ListenError
from patchswarm.daemon.config_values import bind_errors as bind_errors
from patchswarm.daemon.config_values import parse_board_url as parse_board_url
from patchswarm.daemon.config_values import parse_name as parse_name
from patchswarm.daemon.config_values import parse_size as parse_size
from patchswarm.daemon.config_values import split_listen as split_listen
from patchswarm.daemon.config_values import url_host as url_host
from patchswarm.protocol.files import InputFileError, MissingFileError, read_file
from patchswarm.protocol.keys import MAX_KEY_FILE_BYTES
from patchswarm.swarm.serving import ServerLimits
from patchswarm.swarm.tls import TlsError, TlsFiles, TlsReloader

# The keys and the value parsers live in daemon/config_schema.py and daemon/config_values.py; the names
# the command line, the tests and the benchmarks have always taken from here are imported as themselves.


@dataclass(frozen=True)
class DaemonConfig:
    values: Mapping[str, Any]
    source: str
    warnings: tuple[str, ...] = ()  # (TLS files with TLS off, unknown variables) logged once logging is set up

    def __getitem__(self, path: str) -> Any:
        return self.values[path]

    def server_limits(self) -> ServerLimits:
        """The connection cap and deadlines every server of the daemon runs under (``http.*``)."""
        return ServerLimits(
            max_connections=self.values["http.max_connections"],
            max_connections_per_address=self.values["http.max_connections_per_address"],
            header_timeout_s=self.values["http.header_timeout"],
            idle_timeout_s=self.values["http.idle_timeout"],
            body_timeout_s=self.values["http.body_timeout"],
            send_timeout_s=self.values["http.send_timeout"],
        )

    def listen(self, path: str) -> tuple[str, int]:
        """A listen key's (host, port), IPv6 unbracketed."""
        return split_listen(self.values[path])

    @property
    def node_name(self) -> str:
        return str(self.values["node.name"] or socket.gethostname())

    @property
    def store_name(self) -> str:
        return str(self.values["store.name"] or f"patchswarm-{self.values['swarm.run_id']}")

    @property
    def data_dir(self) -> Path:
        return Path(self.values["data.dir"])

    def tls(self) -> TlsReloader | None:
        """The TLS contexts (swarm/tls.py) when tls.enabled; ConfigError naming the file at fault."""
        if not self.values["tls.enabled"]:
            return None
        files = TlsFiles(*(Path(self.values[f"tls.{n}"]) for n in ("ca", "cert", "key")))
        try:
            return TlsReloader(
                files, check_hostname=self.values["tls.check_hostname"], interval_s=self.values["tls.reload_interval"]
            )
        except TlsError as e:
            raise ConfigError(str(e)) from None

    def cluster_secret(self) -> bytes:
        path = Path(self.values["swarm.cluster_secret_file"])
        try:
            secret = read_file(path, MAX_KEY_FILE_BYTES).strip()
        except InputFileError as e:
            raise ConfigError(f"swarm.cluster_secret_file: cannot read {path}: {e.reason}") from None
        if len(secret) < 16:
            raise ConfigError(f"swarm.cluster_secret_file: {path} holds {len(secret)} bytes; at least 16 are needed")
        return secret


def load_config(path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None) -> DaemonConfig:
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            raw = tomllib.loads(read_file(path, 1 << 20).decode("utf-8"))
        except MissingFileError:
            raise ConfigError(f"{path}: no such configuration file") from None
        except InputFileError as e:
            raise ConfigError(str(e)) from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except RecursionError:  # tomllib recurses once per nesting level of arrays and inline tables
            raise ConfigError(f"{path}: not valid TOML (nested too deeply)") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
    return from_mapping(raw, env if env is not None else os.environ, source)


def from_mapping(raw: Mapping[str, Any], env: Mapping[str, str], source: str = "<mapping>") -> DaemonConfig:
    values: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{section}: unknown section (known: {', '.join(SECTIONS)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{section}: must be a table ([{section}])")
        for name in body:
            if f"{section}.{name}" not in BY_PATH:
                known = ", ".join(k.name for k in SCHEMA if k.section == section)
                raise ConfigError(f"{section}.{name}: unknown key (known in [{section}]: {known})")
    for key in SCHEMA:
        value = raw.get(key.section, {}).get(key.name, None)
        where = key.path
        if key.env in env:
            value, where = env[key.env], f"{key.path} (from ${key.env})"
        if value is None:
            if key.required:
                raise ConfigError(f"{key.path}: required ({key.doc})")
            values[key.path] = key.parse(key.default) if key.default is not None else None
            continue
        try:
            values[key.path] = key.parse(value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    _check_ranks(values)
    _check_tls(values)
    return DaemonConfig(values, source, (*_tls_warnings(values), *unknown_env(env)))


def _check_tls(values: Mapping[str, Any]) -> None:
    """With tls.enabled: the three files named, and no peer or seed reached over plain HTTP (a board in an
    object store is read through its SDK, over the provider's HTTPS)."""
    from patchswarm.swarm.board_store import is_store_url
    from patchswarm.swarm.client_errors import shown_url

    if not values["tls.enabled"]:
        return
    for name in ("ca", "cert", "key"):
        if not values[f"tls.{name}"]:
            raise ConfigError(f"tls.{name}: required with tls.enabled")
    for key in ("swarm.bootstrap", "swarm.seed_urls", "node.advertise"):
        value = values[key]
        for url in value if isinstance(value, list) else [value] if value else []:
            if not url.startswith("https://") and not (key == "swarm.seed_urls" and is_store_url(url)):
                raise ConfigError(f"{key}: {shown_url(url)} is plain HTTP and tls.enabled is set: use https://")


def _tls_warnings(values: Mapping[str, Any]) -> list[str]:
    """TLS files named with tls.enabled off: most likely a forgotten switch, and the swarm in the clear."""
    named = [f"tls.{n}" for n in ("ca", "cert", "key") if values[f"tls.{n}"]]
    if values["tls.enabled"] or not named:
        return []
    verb = "is" if len(named) == 1 else "are"
    return [f"{', '.join(named)} {verb} set but tls.enabled is off: the swarm runs over plain HTTP"]


def _check_ranks(values: Mapping[str, Any]) -> None:
    """store.ranks, store.plan and store.devices together (one line naming the key at fault)."""
    ranks, plan, devices = values["store.ranks"], values["store.plan"], values["store.devices"]
    if ranks > 1 and plan == "none":
        raise ConfigError(
            f"store.plan: store.ranks = {ranks} needs a layout plan (auto, a built-in family or a plan file)"
        )
    if values["store.kind"] != "cuda":
        return  # (store.devices is ignored: shm buffers have no device)
    if devices and len(devices) != ranks:
        raise ConfigError(f"store.devices: {len(devices)} device(s) for store.ranks = {ranks}: give one per rank")
    if devices and values["store.device"]:
        raise ConfigError("store.device: set store.devices (one per rank) or store.device, not both")
    if ranks > 1 and values["store.device"]:
        raise ConfigError(f"store.device: one GPU for store.ranks = {ranks}: use store.devices, one per rank")
    if any(d == "cpu" for d in devices):
        raise ConfigError("store.devices: 'cpu' is not a GPU for store.kind 'cuda'")
