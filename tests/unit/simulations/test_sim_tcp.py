"""TCP on the simulator's connections (simulations/tcp_window.py): handshake, slow-start rounds, restart
after idle, the send buffer; and nothing of it where the latency is 0.  Expected times are worked out
by hand from the round model, not from the code."""

from __future__ import annotations

import asyncio

import pytest

from patchswarm.simulations.clock import run_virtual
from patchswarm.simulations.network import Host, Network, Region
from patchswarm.simulations.scenario import ScenarioError, parse_text
from patchswarm.simulations.tcp_window import Connections, TcpModel
from patchswarm.simulations.transport import SimNet
from patchswarm.swarm.transport import Busy, Handlers, Missing, SendChunk

MIB = 1 << 20
IW = 65536  # bytes in the first round trip


def _net(latency: float, tcp: TcpModel | None) -> SimNet:
    hosts = [Host("server", "r", up=1e7), Host("client", "r")]
    return SimNet(Network(hosts, [Region("r", latency=latency)], window=None, tcp=tcp))


def _fetch_times(latency: float, tcp: TcpModel | None, gaps: list[float]) -> tuple[list[float], list[float]]:
    """One 1 MiB chunk per gap (sleeping the gap first), one after another from the same client: how
    long each took, and when the server's write of each returned (from the request's start)."""

    async def main() -> tuple[list[float], list[float]]:
        net = _net(latency, tcp)
        loop = asyncio.get_running_loop()
        writes: list[float] = []

        async def chunk(h: bytes, requester: str, held: int, send: SendChunk) -> Busy | Missing | None:
            await send(b"c" * MIB)
            writes.append(loop.time())
            return None

        net.register("sim://server", "server", Handlers(lambda d: None, chunk, lambda p, r, i: _none()))
        client = net.transport("client")
        took, wrote = [], []
        for gap in gaps:
            await asyncio.sleep(gap)
            t = loop.time()
            assert await client.get_chunk("sim://server", b"a", MIB, 60.0, "client") == b"c" * MIB
            took.append(loop.time() - t)
            await asyncio.sleep(0)  # the handler's task ends
            wrote.append(writes[-1] - t)
        net.close()
        return took, wrote

    return run_virtual(main())


async def _none() -> None:
    return None


def test_a_new_connection_pays_its_handshake_then_doubles_its_window_each_round_trip() -> None:
    # RTT 0.1 s, 10 MB/s uplink, first window 64 KiB.  Request 1, a new connection: handshake 0.1 s,
    # the request 0.05 s, the first byte 0.05 s, then rounds of 64, 128, 256 and 512 KiB (0.1 s each,
    # the window binds) and the last 64 KiB at the uplink's rate (the window, 1 MiB, no longer binds).
    # Request 2 at once: the window (64 KiB + 1 MiB) carries the whole chunk at the uplink's rate.
    # Request 3 after 1 s idle: RTO = RTT + 0.2 s = 0.3 s, three halvings of 2 MiB + 64 KiB: 264 KiB,
    # then 528 KiB, then the remaining 232 KiB at the uplink's rate.
    took, _ = _fetch_times(0.05, TcpModel(IW), [0.0, 0.0, 1.0])
    first = 0.1 + 0.05 + 0.05 + 4 * 0.1 + IW / 1e7
    second = 0.05 + 0.05 + MIB / 1e7
    w = (IW + MIB + MIB) / 8
    third = 0.05 + 0.05 + 0.1 + 0.1 + (MIB - w - 2 * w) / 1e7
    assert took == pytest.approx([first, second, third])


def test_without_restart_after_idle_the_window_is_kept() -> None:
    took, _ = _fetch_times(0.05, TcpModel(IW, restart_after_idle=False), [0.0, 5.0])
    assert took[1] == pytest.approx(0.05 + 0.05 + MIB / 1e7)


def test_with_no_latency_the_model_changes_nothing() -> None:
    plain, _ = _fetch_times(0.0, None, [0.0, 0.0, 1.0])
    assert plain == pytest.approx([MIB / 1e7] * 3)
    assert _fetch_times(0.0, TcpModel(IW, send_buffer=4 * MIB), [0.0, 0.0, 1.0])[0] == plain


def test_a_reply_that_fits_the_send_buffer_frees_the_server_at_once() -> None:
    # The server's write returns when the request has arrived (after the handshake and one latency)
    # when the socket takes the whole chunk; otherwise it lasts until the bytes are through.
    took, wrote = _fetch_times(0.05, TcpModel(IW, send_buffer=2 * MIB), [0.0])
    assert took == pytest.approx([0.1 + 0.05 + 0.05 + 4 * 0.1 + IW / 1e7])
    assert wrote == pytest.approx([0.1 + 0.05])
    took, wrote = _fetch_times(0.05, TcpModel(IW, send_buffer=MIB - 1), [0.0])
    assert wrote == pytest.approx(took)


def test_connections_are_reused_last_freed_first_and_forgotten_with_their_host() -> None:
    conns = Connections(TcpModel(1000.0))
    a = conns.take("s", "c", 0.0, 0.1)
    b = conns.take("s", "c", 0.0, 0.1)
    assert a is not b and a.new and b.new and conns.opened == 2
    a.cwnd, b.cwnd = 5000.0, 7000.0
    conns.give_back(a, 1.0)
    conns.give_back(b, 1.0)
    again = conns.take("s", "c", 1.1, 0.1)  # idle 0.1 s < RTO 0.3 s: window kept
    assert again is b and not again.new and again.cwnd == 7000.0
    late = conns.take("s", "c", 1.0 + 0.65, 0.1)  # idle 0.65 s = two RTOs: halved twice, not under 1000
    assert late is a and late.cwnd == 1250.0 and conns.restarts == 1
    conns.give_back(late, 2.0)
    conns.forget_host("c")
    assert conns.take("s", "c", 2.0, 0.1).new and conns.opened == 3


def test_tcp_model_refuses_nonsense() -> None:
    for kw in ({"initial_window": 0.0}, {"initial_window": float("inf")}, {"initial_window": 1.0, "rto_min": -1.0}):
        with pytest.raises(ValueError):
            TcpModel(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TcpModel(1.0, send_buffer=float("nan"))


def test_the_scenario_keys() -> None:
    base = '[hosts]\ncount = 4\n[payload]\npatch_size = "10MB"\nchunk_size = "1MiB"\n'
    s = parse_text(base)
    assert s.tcp is None and s.seed_paced
    s = parse_text(base + '[seed]\npaced = false\n[network]\ninitial_window = "64KiB"\nsend_buffer = "2MiB"\n')
    assert s.tcp == TcpModel(65536.0, restart_after_idle=True, send_buffer=2.0 * MIB) and not s.seed_paced
    s = parse_text(base + "[network]\ninitial_window = 14600\nslow_start_after_idle = false\n")
    assert s.tcp == TcpModel(14600.0, restart_after_idle=False)
    with pytest.raises(ScenarioError, match="initial_window"):
        parse_text(base + "[network]\ninitial_window = -1\n")


def test_the_testbed_gives_the_simulator_its_tcp() -> None:
    """benchmarks/latency_testbed.py's scenario parses, with the hosts' TCP and the seed's pacing."""
    import argparse

    from benchmarks.latency_testbed import scenario_toml

    off = '{"node": {"upload_notsent_lowat": 0}, "seed": {"upload_notsent_lowat": 0}}'
    args = argparse.Namespace(
        regions=2, hosts=3, rate=2e6, chunk_mib=1, mtu=64000, initcwnd=1, notsent_lowat=0,
        no_slow_start_after_idle=False, pace=False, config=off,
    )  # fmt: skip
    owd = {(0, 1): 0.02, (1, 0): 0.02}
    s = parse_text(scenario_toml(args, owd, 0.0001, 2_000_000))
    assert s.tcp == TcpModel(63948.0, restart_after_idle=True, send_buffer=20 * 63948.0 + 65536)
    assert not s.seed_paced and s.hosts == 6
    args.initcwnd, args.notsent_lowat, args.no_slow_start_after_idle = 0, 131072, True
    args.config = '{"seed": {"upload_rate": 2e6}}'
    s = parse_text(scenario_toml(args, owd, 0.0001, 2_000_000))
    assert s.tcp == TcpModel(10 * 63948.0, restart_after_idle=False, send_buffer=0.0)
    assert s.seed_paced
    # The node's own TCP_NOTSENT_LOWAT (upload_notsent_lowat, on by default) holds the slot for the
    # wire only where both the seed and the nodes set it; the simulator has one send buffer for all.
    args.notsent_lowat, args.config = 0, None
    assert parse_text(scenario_toml(args, owd, 0.0001, 2_000_000)).tcp.send_buffer == 0.0
    args.config = '{"seed": {"upload_notsent_lowat": 0}}'
    assert parse_text(scenario_toml(args, owd, 0.0001, 2_000_000)).tcp.send_buffer == 20 * 63948.0 + 65536
    args.config = '{"node": {"upload_notsent_lowat": 131072}, "seed": {"upload_notsent_lowat": 65536}}'
    s = parse_text(scenario_toml(args, owd, 0.0001, 2_000_000, rng_seed=7))
    assert s.tcp.send_buffer == 0.0 and s.rng_seed == 7


def test_the_testbed_delay_inside_a_region() -> None:
    """Half the lowest in-region median RTT; a testbed of one host per region has no in-region pair
    (it crashed there before the simulator's run) and leaves the bridge's delay out."""
    from benchmarks.latency_testbed import intra_region_delay

    def row(configured: float, median: float) -> dict[str, float]:
        return {"configured_ms": configured, "median_ms": median}

    rows = [row(0.0, 0.3), row(20.0, 20.1), row(0.0, 0.2)]
    assert intra_region_delay({"rtt": rows}) == pytest.approx(0.0001)
    assert intra_region_delay({"rtt": [row(20.0, 20.1), row(150.0, 150.4)]}) == 0.0
