"""``patchswarm engine transformers``: serve a causal LM from the rollout daemon's weight store (docs/engines.md).

The engine attaches to the daemon's store (``DaemonClient.open_store``: a host store is mapped,
an engine-buffer store is allocated on ``--device`` and registered), builds the model of
``--checkpoint``'s config over it (daemon/tf_model.py) and serves the OpenAI API
(daemon/openai_api.py).  It follows the store's fence and acknowledges each version it serves to
the daemon (POST /v1/ack, again every few seconds: a restarted daemon forgets).  Without
``--daemon`` it serves DIR's own safetensors as version 0 (standalone, for comparison).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchswarm.daemon import cli_args
from patchswarm.daemon.user_error import UserError

if TYPE_CHECKING:
    from patchswarm.daemon.sidecar import RunningServer


def add_engine_parser(sub: Any) -> None:
    eng = sub.add_parser("engine", help="serve a model straight from the daemon's weight store")
    kinds = eng.add_subparsers(dest="engine", required=True)
    tf = kinds.add_parser("transformers", help="a Hugging Face transformers causal LM, OpenAI API")
    tf.add_argument("--checkpoint", type=cli_args.checkpoint_dir, required=True, metavar="DIR",
                    help="config.json, generation_config.json and the tokenizer files")  # fmt: skip
    tf.add_argument(
        "--daemon", type=cli_args.path, metavar="SOCKET", help="the daemon's api.socket (else: DIR's weights)"
    )
    tf.add_argument("--listen", type=cli_args.listen, default="127.0.0.1:8000", metavar="HOST:PORT")
    tf.add_argument("--device", type=cli_args.device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    tf.add_argument("--engine-name", type=cli_args.node_name, default="transformers", metavar="NAME",
                    help="the name given to the daemon (registration, acks)")  # fmt: skip
    tf.add_argument("--max-tokens-limit", type=cli_args.max_tokens_limit, default=1024, metavar="N")
    tf.add_argument("--prefix-cache-entries", type=cli_args.prefix_cache_entries, default=16, metavar="N",
                    help="prompts whose KV state is kept, per version (0: off)")  # fmt: skip
    tf.add_argument("--fence-wait", type=cli_args.fence_wait, default=10.0, metavar="SECONDS",
                    help="how long a request waits for a stable version before a 503")  # fmt: skip
    tf.add_argument("--pause-limit", type=cli_args.fence_wait, default=60.0, metavar="SECONDS",
                    help="the longest a pause holds a request (a daemon gone mid-activation)")  # fmt: skip
    tf.add_argument("--wait", type=cli_args.seconds, default=300.0, metavar="SECONDS",
                    help="how long to wait for the daemon's store and first version")  # fmt: skip
    tf.set_defaults(func=cmd_engine_transformers)


def _open(args: argparse.Namespace) -> tuple[Any, Any]:
    import time

    from patchswarm.daemon.engine_client import DaemonClient
    from patchswarm.daemon.store_format import StoreError
    from patchswarm.daemon.tf_engine import StaticWeights

    if not args.daemon:
        try:
            return StaticWeights.from_checkpoint(Path(args.checkpoint), args.device), None
        except ValueError as e:  # (ModelMismatch: config.json transformers cannot read)
            raise UserError(f"--checkpoint {args.checkpoint}: {e}") from None
    client = DaemonClient(args.daemon)
    try:
        view = client.open_store(args.device, args.engine_name, args.wait)
    except (StoreError, OSError) as e:
        raise UserError(f"--daemon {args.daemon}: {e}") from None
    if view.data.device.type != args.device.partition(":")[0]:
        view.close()
        raise UserError(
            f"the daemon's store is in {view.data.device.type} memory: serve it with --device {view.data.device.type}"
        )
    deadline = time.monotonic() + args.wait
    while view.read_version() is None:
        if time.monotonic() > deadline:
            view.close()
            raise UserError(f"no version in the daemon's store after {args.wait:g} s")
        time.sleep(0.05)
    return view, client


def cmd_engine_transformers(args: argparse.Namespace) -> int:
    from patchswarm.daemon.engine_client import follow_daemon
    from patchswarm.daemon.engine_serve import serve_until_signal
    from patchswarm.daemon.openai_api import make_openai_app
    from patchswarm.daemon.tf_engine import TfEngine
    from patchswarm.daemon.tf_model import ModelMismatch

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("the transformers engine needs transformers: pip install 'patchswarm[transformers]'") from None
    view, client = _open(args)
    try:
        try:
            engine = TfEngine(
                view, Path(args.checkpoint), max_tokens_limit=args.max_tokens_limit,
                prefix_cache_entries=args.prefix_cache_entries, fence_wait_s=args.fence_wait,
                pause_limit_s=args.pause_limit,
            )  # fmt: skip
        except (ModelMismatch, OSError, ValueError) as e:
            raise UserError(f"--checkpoint {args.checkpoint}: {e}") from None

        def started(server: RunningServer) -> None:
            if client is None:
                engine.note_served(0)
            print(f"transformers engine serving {engine.model_name} (version {engine.current_version()}) "
                  f"at {server.url}", flush=True)  # fmt: skip

        def served(ready: int | None) -> int | None:
            if ready is not None:
                engine.note_served(ready)  # (what it serves once in-flight requests moved on)
            return engine.served

        async def follow() -> None:
            await follow_daemon(client, view, args.engine_name, served=served)

        async def run() -> None:
            await serve_until_signal(
                make_openai_app(engine), args.listen, default_host="0.0.0.0",
                follow=follow if client is not None else None, started=started,
            )  # fmt: skip

        asyncio.run(run())
    finally:
        close = getattr(view, "close", None)
        if close is not None:
            close()
    return 0
