"""patchswarm: lossless weight patches for RL post-training, moved by a verified peer-to-peer swarm.

The public API, importable from here (``from patchswarm import Publisher``); the layers behind it are
``patchswarm.protocol`` (formats and sans-IO state machines), ``patchswarm.swarm`` (the asyncio node),
``patchswarm.daemon`` (the processes) and ``patchswarm.simulations`` (the virtual-time simulator);
docs/architecture.md maps each concept to its module.

The names load on first use (PEP 562), so importing ``patchswarm`` (as every subpackage import does)
costs nothing: ``patchswarm --help`` must not load torch.

This folder holds only this file: the four subpackages are the top-level folders of the repository,
installed under this name by setuptools' package-dir mapping (pyproject.toml); the links beside this
file give tools that read the source tree (mypy, ``python -m`` from a checkout) the same names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    # trainer: publish versions to a board
    "Publisher": "patchswarm.daemon.publisher",
    "PublishInfo": "patchswarm.daemon.publish_chain",
    "ShardedPublish": "patchswarm.daemon.sharded_publish",
    "ShardPart": "patchswarm.daemon.sharded_publish",
    "ServedFormat": "patchswarm.daemon.served_format",
    "DistPublisher": "patchswarm.daemon.publish_dist",
    "DistPublishError": "patchswarm.daemon.publish_dist",
    "Board": "patchswarm.daemon.board",
    "HeadRaceError": "patchswarm.daemon.board",
    "StoreBoard": "patchswarm.daemon.board_store",
    "open_board": "patchswarm.daemon.board_store",
    "SigningKey": "patchswarm.protocol.keys",
    "TrustedKeys": "patchswarm.protocol.keys",
    "load_public_key": "patchswarm.protocol.keys",
    # Hugging Face checkpoints in and out (docs/models.md)
    "Checkpoint": "patchswarm.daemon.checkpoint",
    "read_checkpoint": "patchswarm.daemon.checkpoint",
    "write_checkpoint": "patchswarm.daemon.checkpoint_writer",
    # the served model and the patch format
    "ServedModel": "patchswarm.protocol.served",
    "TensorSpec": "patchswarm.protocol.served",
    "Version": "patchswarm.protocol.patchfile",
    "build_version": "patchswarm.protocol.patchfile",
    "apply_version": "patchswarm.protocol.patchfile",
    "open_file": "patchswarm.protocol.patchfile",
    "write_file": "patchswarm.protocol.patchfile",
    "PatchswarmError": "patchswarm.protocol.errors",
    # consumers: follow a board, talk to a rollout daemon, gate requests by version
    "Puller": "patchswarm.swarm.puller",
    "Held": "patchswarm.protocol.held",
    "source_for": "patchswarm.swarm.board_sources",
    "DaemonClient": "patchswarm.daemon.engine_client",
    "VersionGate": "patchswarm.daemon.sidecar_gate",
    "VersionConstraint": "patchswarm.daemon.sidecar_gate",
    "make_sidecar_app": "patchswarm.daemon.sidecar",
    "start_sidecar": "patchswarm.daemon.sidecar",
}

__all__ = [
    "Board",
    "Checkpoint",
    "DaemonClient",
    "DistPublishError",
    "DistPublisher",
    "HeadRaceError",
    "Held",
    "PatchswarmError",
    "PublishInfo",
    "Publisher",
    "Puller",
    "ServedFormat",
    "ServedModel",
    "ShardPart",
    "ShardedPublish",
    "SigningKey",
    "StoreBoard",
    "TensorSpec",
    "TrustedKeys",
    "Version",
    "VersionConstraint",
    "VersionGate",
    "apply_version",
    "build_version",
    "load_public_key",
    "make_sidecar_app",
    "open_board",
    "open_file",
    "read_checkpoint",
    "source_for",
    "start_sidecar",
    "write_checkpoint",
    "write_file",
]  # = sorted(_EXPORTS) (tests/unit/test_package.py)

if TYPE_CHECKING:
    from patchswarm.daemon.board import Board, HeadRaceError
    from patchswarm.daemon.board_store import StoreBoard, open_board
    from patchswarm.daemon.checkpoint import Checkpoint, read_checkpoint
    from patchswarm.daemon.checkpoint_writer import write_checkpoint
    from patchswarm.daemon.engine_client import DaemonClient
    from patchswarm.daemon.publish_chain import PublishInfo
    from patchswarm.daemon.publish_dist import DistPublisher, DistPublishError
    from patchswarm.daemon.publisher import Publisher
    from patchswarm.daemon.served_format import ServedFormat
    from patchswarm.daemon.sharded_publish import ShardedPublish, ShardPart
    from patchswarm.daemon.sidecar import make_sidecar_app, start_sidecar
    from patchswarm.daemon.sidecar_gate import VersionConstraint, VersionGate
    from patchswarm.protocol.errors import PatchswarmError
    from patchswarm.protocol.held import Held
    from patchswarm.protocol.keys import SigningKey, TrustedKeys, load_public_key
    from patchswarm.protocol.patchfile import Version, apply_version, build_version, open_file, write_file
    from patchswarm.protocol.served import ServedModel, TensorSpec
    from patchswarm.swarm.board_sources import source_for
    from patchswarm.swarm.puller import Puller


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'patchswarm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
