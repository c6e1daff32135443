"""``patchswarm daemon`` and ``patchswarm status``: the rollout daemon run, and read through its socket."""

from __future__ import annotations

import argparse

from patchswarm.daemon.user_error import UserError


def cmd_daemon(args: argparse.Namespace) -> int:
    import asyncio

    from patchswarm.daemon.config import ConfigError, load_config
    from patchswarm.daemon.logs import setup_logging
    from patchswarm.daemon.rollout import DaemonError, run_daemon
    from patchswarm.daemon.store_format import StoreError

    try:
        cfg = load_config(args.config)
        cfg.cluster_secret()
    except ConfigError as e:
        raise UserError(str(e)) from None
    setup_logging(cfg["log.format"], cfg["log.level"])
    try:
        asyncio.run(run_daemon(cfg))
    except (DaemonError, ConfigError, StoreError) as e:
        raise UserError(str(e)) from None
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from patchswarm.daemon.status_cli import StatusError, run_status

    socket_path = args.socket
    if socket_path is None and args.config:
        from patchswarm.daemon.config import ConfigError, load_config

        try:
            socket_path = load_config(args.config)["api.socket"]
        except ConfigError as e:
            raise UserError(str(e)) from None
    try:
        return run_status(socket_path or "/run/patchswarm/api.sock", as_json=args.json, live=args.watch)
    except StatusError as e:
        raise UserError(str(e)) from None
