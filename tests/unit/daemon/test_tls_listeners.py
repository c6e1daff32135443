"""The daemon's other TCP listeners over mutual TLS (sidecar, metrics), and the tls.* configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from patchswarm.daemon.config import ConfigError, from_mapping
from patchswarm.daemon.metrics import serve_metrics
from patchswarm.daemon.sidecar import VersionGate, serve_app, start_sidecar
from tests.support.tlskit import Pki, get_status, raw_exchange

SECRET_BODY = b"engine-only answer 7f3a"
REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


async def _refused_everywhere(pki: Pki, url: str, port: int, request: bytes, secret: bytes) -> None:
    for who in (None, "foreign", "expired"):
        got = await get_status(url, pki.client(who))
        assert isinstance(got, str), (who, got)  # no status, no body
        leaked = await raw_exchange(port, pki.client(who), request)
        assert b"HTTP" not in leaked and secret not in leaked, who


@pytest.mark.asyncio
async def test_sidecar_over_mutual_tls(pki: Pki) -> None:
    async def engine(_: web.Request) -> web.Response:
        return web.Response(body=SECRET_BODY)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine)
    upstream = await serve_app(app)
    sidecar = await start_sidecar(upstream.url, VersionGate(applied=1), ssl_context=pki.reloader("h1").server_context())
    try:
        assert sidecar.url.startswith("https://")
        url = f"{sidecar.url}/v1/models"
        assert await get_status(url, pki.client("client")) == (200, SECRET_BODY)
        await _refused_everywhere(pki, url, sidecar.port, REQUEST, SECRET_BODY)
    finally:
        await sidecar.close()
        await upstream.close()


@pytest.mark.asyncio
async def test_metrics_over_mutual_tls(pki: Pki) -> None:
    body = b"patchswarm_secret_gauge 42\n"
    runner = await serve_metrics(lambda: body, "127.0.0.1:0", ssl_context=pki.reloader("h2").server_context())
    try:
        port = runner.addresses[0][1]
        url = f"https://127.0.0.1:{port}/metrics"
        assert await get_status(url, pki.client("client")) == (200, body)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        await _refused_everywhere(pki, url, port, request, body)
    finally:
        await runner.cleanup()


BASE: dict[str, Any] = {"swarm": {"run_id": "r", "cluster_secret_file": "/s"}, "trust": {"root": "/r"}}


def _config(tls: dict[str, Any], swarm: dict[str, Any] | None = None) -> Any:
    raw = {**BASE, "tls": tls, "swarm": {**BASE["swarm"], **(swarm or {})}}
    return from_mapping(raw, {})


def test_tls_config_refuses_half_setups_and_plain_peers(pki: Pki, tmp_path: Path) -> None:
    files = {"ca": str(pki.ca), "cert": str(pki.root / "h1.pem"), "key": str(pki.root / "h1.key")}
    assert _config({}).tls() is None  # off by default: plain HTTP for loopback tests
    with pytest.raises(ConfigError, match=r"^tls\.key: required with tls\.enabled$"):
        _config({"enabled": True, "ca": files["ca"], "cert": files["cert"]})
    for key in ("bootstrap", "seed_urls"):
        with pytest.raises(ConfigError, match=rf"^swarm\.{key}: http://seed:8700 is plain HTTP"):
            _config({"enabled": True, **files}, {key: ["https://a:1", "http://seed:8700"]})
    # A store board is read through its SDK, over the provider's HTTPS: allowed with the cluster's TLS.
    assert _config({"enabled": True, **files}, {"seed_urls": ["s3://my-board/p", "https://a:1"]}).tls() is not None
    cfg = _config({"enabled": True, **files}, {"bootstrap": ["https://seed:8700"]})
    tls = cfg.tls()
    assert tls is not None and tls.files.cert == pki.root / "h1.pem"
    with pytest.raises(ConfigError, match="not issued by a CA"):
        _config({"enabled": True, **files, "cert": str(pki.root / "foreign.pem")}).tls()
    env_cfg = from_mapping({**BASE, "tls": files}, {"PATCHSWARM_TLS_ENABLED": "1"})
    assert env_cfg["tls.enabled"] is True


def test_tls_files_with_tls_off_are_warned_about(pki: Pki) -> None:
    # TLS files named but tls.enabled forgotten: the swarm would run in the clear without a word.
    files = {"ca": str(pki.ca), "cert": str(pki.root / "h1.pem"), "key": str(pki.root / "h1.key")}
    [line] = _config(files).warnings
    assert line == "tls.ca, tls.cert, tls.key are set but tls.enabled is off: the swarm runs over plain HTTP"
    [line] = _config({"cert": files["cert"]}).warnings
    assert line == "tls.cert is set but tls.enabled is off: the swarm runs over plain HTTP"
    assert _config({}, {"seed_urls": ["https://cdn.example/board"]}).warnings == ()  # (a public https board)
    assert _config({}).warnings == ()
    assert _config({"enabled": True, **files}).warnings == ()
