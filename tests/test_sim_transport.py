"""Virtual time for asyncio and the simulated Transport: no wall-clock waiting, exact virtual timings."""

from __future__ import annotations

import asyncio
import math
import operator
import socket
from typing import Any

import pytest

from patchswarm.simulations.clock import SimClock, VirtualTimeDeadlock, VirtualTimeLoop, run_virtual
from patchswarm.simulations.network import Host, Network, Region
from patchswarm.simulations.transport import SimNet, placeholder_bytes
from patchswarm.swarm.transport import Busy, ChunkReply, Clock, Handlers, Missing, SendChunk, Transport, TransportError


def test_sleeping_an_hour_takes_an_hour_of_virtual_time_exactly() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        t1 = loop.time()
        await asyncio.gather(asyncio.sleep(0.25), asyncio.sleep(0.5), asyncio.sleep(0.125))
        return t1, loop.time()

    assert run_virtual(main()) == (3600.0, 3600.5)


def test_timeouts_and_wait_for_run_in_virtual_time() -> None:
    async def main() -> float:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(10):
                await asyncio.Event().wait()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100), 5)
        return asyncio.get_running_loop().time()

    assert run_virtual(main(), start=1.0) == 16.0


def test_timers_fire_in_deadline_order() -> None:
    async def main() -> list[int]:
        order: list[int] = []
        loop = asyncio.get_running_loop()
        for i, t in enumerate([0.3, 0.1, 0.2, 0.1]):
            loop.call_later(t, order.append, i)
        await asyncio.sleep(1)
        return order

    assert run_virtual(main()) == [1, 3, 2, 0]


def test_a_loop_with_nothing_left_to_do_reports_a_deadlock() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    loop = VirtualTimeLoop(idle_wall_timeout=0.01)
    try:
        with pytest.raises(VirtualTimeDeadlock):
            loop.run_until_complete(main())
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
            loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        loop.close()


async def _timers_and_a_failing_callback() -> tuple[list[object], float]:
    """Timers (one cancelled), a callback that raises (caught by the exception handler), a sleep."""
    loop = asyncio.get_running_loop()
    seen: list[object] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(type(context["exception"]).__name__))
    loop.call_later(0.2, seen.append, "b")
    loop.call_at(loop.time() + 0.1, seen.append, "a")
    loop.call_later(0.15, seen.append, "cancelled").cancel()
    loop.call_soon(operator.truediv, 1, 0)
    loop.call_later(0.05, operator.truediv, 1, 0)
    await asyncio.sleep(0.3)
    return seen, loop.time()


@pytest.mark.parametrize("debug", [False, True])
def test_debug_mode_runs_the_same_on_asyncio_s_own_handles(debug: bool) -> None:
    """In debug mode asyncio's checked call_soon/call_at and handles feed the same queue and heap."""

    async def main() -> tuple[tuple[list[object], float], bool]:
        loop = asyncio.get_running_loop()
        assert loop.get_debug() == debug
        native = isinstance(loop.call_later(1, print), asyncio.TimerHandle)
        return await _timers_and_a_failing_callback(), native

    result, asyncio_handles = run_virtual(main(), debug=debug)
    assert result == (["ZeroDivisionError", "ZeroDivisionError", "a", "b"], 0.3)
    assert asyncio_handles == debug


def test_a_task_factory_set_on_the_loop_makes_its_tasks() -> None:
    made: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kwargs)

    async def child() -> int:
        return 7

    async def main() -> int:
        asyncio.get_running_loop().set_task_factory(factory)
        return await asyncio.get_running_loop().create_task(child())

    assert run_virtual(main()) == 7
    assert made[0].endswith("<locals>.child")  # (then asyncio.Runner's own shutdown tasks)


def test_a_closed_loop_refuses_callbacks_and_a_nan_deadline_is_refused() -> None:
    loop = VirtualTimeLoop()
    with pytest.raises(ValueError, match="NaN"):
        loop.call_at(math.nan, print)
    loop.close()
    for schedule in (lambda: loop.call_soon(print), lambda: loop.call_later(1, print)):
        with pytest.raises(RuntimeError, match="closed"):
            schedule()


def test_real_io_still_arrives_on_a_virtual_loop() -> None:
    """A watched file is polled before the clock jumps: its data arrives while timers are pending."""

    async def main() -> tuple[bytes, float]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        with a, b:
            got: asyncio.Future[bytes] = loop.create_future()
            loop.add_reader(b, lambda: got.set_result(b.recv(16)))
            loop.call_later(5, lambda: None)  # a pending timer: the loop must not just jump past the data
            a.send(b"hello")
            data = await got
            loop.remove_reader(b)
        return data, loop.time()

    assert run_virtual(main()) == (b"hello", 0.0)


def test_long_lived_state_is_frozen_for_the_run_only() -> None:
    """Inside ``run_virtual`` what ``long_lived`` builds is kept out of the collector's scans (frozen,
    built with the collector off) until the run ends; outside one the block changes nothing."""
    import gc

    from patchswarm.simulations.clock import long_lived

    frozen, enabled = gc.get_freeze_count(), gc.isenabled()
    with long_lived():
        assert gc.isenabled() == enabled
        kept = [[i] for i in range(1000)]
    assert gc.get_freeze_count() == frozen

    async def main() -> tuple[bool, int, int]:
        before = gc.get_freeze_count()
        with long_lived():
            off = not gc.isenabled()
            state = [[i] for i in range(1000)]
        return off and gc.isenabled(), gc.get_freeze_count() - before, len(state)

    collector_back, newly_frozen, _ = run_virtual(main())
    assert collector_back
    assert newly_frozen >= 1000
    assert gc.get_freeze_count() == frozen and gc.isenabled() == enabled and len(kept) == 1000


def test_sim_clock_is_a_clock() -> None:
    async def main() -> tuple[float, float]:
        clock: Clock = SimClock(epoch=1_700_000_000.0)
        await clock.sleep(2.5)
        await clock.sleep(-1)
        return clock.now(), clock.wall()

    assert run_virtual(main()) == (2.5, 1_700_000_002.5)


def test_a_sim_clock_follows_the_loop_it_is_read_on() -> None:
    """Reused across runs it reads each run's loop; on a stock asyncio loop, that loop's time()."""
    clock = SimClock(epoch=0.0)

    async def now_after(seconds: float) -> float:
        await clock.sleep(seconds)
        return clock.now()

    assert run_virtual(now_after(1.0)) == 1.0
    assert run_virtual(now_after(0.5), start=100.0) == 100.5
    loop = asyncio.new_event_loop()
    try:
        t0 = loop.time()
        assert t0 <= loop.run_until_complete(now_after(0.0)) <= loop.time()
    finally:
        loop.close()


# ---------------------------------------------------------------- transport


def make_net() -> SimNet:
    hosts = [Host("server", "r", up=1e6), Host("client", "r"), Host("other", "r")]
    return SimNet(Network(hosts, [Region("r", latency=0.01)], window=None))


def serving(chunks: dict[bytes, ChunkReply], objects: dict[str, bytes], log: list[bytes]) -> Handlers:
    def gossip(data: bytes) -> None:
        log.append(data)

    async def chunk(h: bytes, requester: str, held: int, send: SendChunk) -> Busy | Missing | None:
        reply = chunks.get(h, Missing())
        if isinstance(reply, bytes):
            await send(reply)
            return None
        return reply

    async def obj(path: str, requester: str, insist: bool) -> bytes | None:
        return objects.get(path)

    return Handlers(gossip, chunk, obj)


def test_chunk_request_costs_request_latency_then_latency_plus_transfer() -> None:
    async def main() -> list[tuple[str, float]]:
        net = make_net()
        log: list[bytes] = []
        busy = Busy(0.5, ("n1",))
        net.register("sim://server", "server", serving({b"a": b"x" * 500_000, b"b": busy}, {"o": b"y" * 10}, log))
        client: Transport = net.transport("client")
        loop = asyncio.get_running_loop()
        out: list[tuple[str, float]] = []
        t = loop.time()
        reply = await client.get_chunk("sim://server", b"a", 500_000, 10.0, "client")
        assert reply == b"x" * 500_000
        out.append(("chunk", loop.time() - t))
        t = loop.time()
        assert await client.get_chunk("sim://server", b"b", 10, 10.0, "client") == busy
        out.append(("busy", loop.time() - t))
        t = loop.time()
        assert isinstance(await client.get_chunk("sim://server", b"zz", 10, 10.0, "client"), Missing)
        assert await client.get_object("sim://server", "o", 100, 1.0) == b"y" * 10
        assert await client.get_object("sim://server", "nope", 100, 1.0) is None
        out.append(("three more", loop.time() - t))
        await client.send("sim://server", b"hello")
        assert log == [b"hello"]
        with pytest.raises(TransportError):
            await client.get_object("sim://server", "o", 5, 1.0)  # over the limit
        with pytest.raises(TransportError):
            await client.get_chunk("sim://server", b"a", 500_000, 0.3, "client")  # needs 0.52 s
        with pytest.raises(TransportError):
            await client.send("sim://nobody", b"x")
        await asyncio.sleep(1.0)
        assert net.network.active_flows() == []  # the timed-out flow was cancelled
        net.close()
        return out

    out = dict(run_virtual(main()))
    assert out["chunk"] == pytest.approx(0.01 + 0.01 + 0.5)
    assert out["busy"] == pytest.approx(0.02)
    assert out["three more"] == pytest.approx(0.02 + (0.02 + 10 / 1e6) + 0.02)


def test_a_refusal_given_at_once_skips_the_handler_and_takes_the_same_time() -> None:
    """``Handlers.refuse``: the transport asks it first; its refusal comes back one latency after
    the request arrived, as the handler's would, and the handler never runs; None goes on to it."""

    async def main() -> tuple[float, list[bytes]]:
        net = make_net()
        base = serving({b"a": b"x" * 1000}, {}, [])
        called: list[bytes] = []

        async def chunk(h: bytes, requester: str, held: int, send: SendChunk) -> Busy | Missing | None:
            called.append(h)
            return await base.chunk(h, requester, held, send)

        def refuse(h: bytes, requester: str, held: int) -> Busy | Missing | None:
            return Busy(0.5) if h == b"busy" else None

        net.register("sim://server", "server", Handlers(base.gossip, chunk, base.object, refuse))
        client = net.transport("client")
        loop = asyncio.get_running_loop()
        t = loop.time()
        assert await client.get_chunk("sim://server", b"busy", 10, 10.0, "client") == Busy(0.5)
        took = loop.time() - t
        assert await client.get_chunk("sim://server", b"a", 1000, 10.0, "client") == b"x" * 1000
        net.close()
        return took, called

    took, called = run_virtual(main())
    assert took == pytest.approx(0.02)
    assert called == [b"a"]


def test_post_delivers_one_latency_later_and_drops_what_cannot_arrive() -> None:
    async def main() -> list[tuple[float, bytes]]:
        net = make_net()
        loop = asyncio.get_running_loop()
        got: list[tuple[float, bytes]] = []
        handlers = serving({}, {}, [])
        net.register(
            "sim://server", "server", Handlers(lambda d: got.append((loop.time(), d)), handlers.chunk, handlers.object)
        )
        client = net.transport("client")
        client.post("sim://server", b"one")  # returns at once; arrives one latency (10 ms) later
        assert got == []
        client.post("sim://nobody", b"lost")  # no such address: dropped, no error
        await asyncio.sleep(0.02)
        client.post("sim://server", b"two")
        net.unregister("sim://server")  # gone before "two" arrives: dropped on arrival
        await asyncio.sleep(0.1)
        await client.close()
        client.post("sim://server", b"closed")  # a closed transport sends nothing
        await asyncio.sleep(0.1)
        assert net.stats.gossip_messages == 2
        return got

    assert run_virtual(main()) == [(pytest.approx(0.01), b"one")]


def test_concurrent_downloads_share_the_server_uplink() -> None:
    async def main() -> list[float]:
        net = make_net()
        net.register("sim://server", "server", serving({b"a": b"z" * 1_000_000}, {}, []))
        loop = asyncio.get_running_loop()

        async def fetch(host: str) -> float:
            await net.transport(host).get_chunk("sim://server", b"a", 1 << 20, 60.0, host)
            return loop.time()

        times = await asyncio.gather(fetch("client"), fetch("other"))
        net.close()
        return list(times)

    # Two 1 MB replies over one 1 MB/s uplink: both end after 2 s of transfer plus two latencies.
    assert run_virtual(main()) == pytest.approx([2.02, 2.02])


def test_placeholders_are_shared_and_sized() -> None:
    a, b = placeholder_bytes(4 << 20), placeholder_bytes(4 << 20)
    assert a is b and len(a) == 4 << 20 and not any(a[:16])
    assert math.isclose(len(placeholder_bytes(10)), 10)


def test_a_crashed_host_stops_its_flows_and_answers_nothing() -> None:
    async def main() -> tuple[float, float, float]:
        net = make_net()
        net.register("sim://server", "server", serving({b"a": b"x" * 1_000_000}, {}, []))
        loop = asyncio.get_running_loop()
        fetch = asyncio.ensure_future(net.transport("client").get_chunk("sim://server", b"a", 1 << 20, 60.0, "client"))
        await asyncio.sleep(0.52)  # request 0.01 + latency 0.01: 0.5 s of transfer done, half the chunk
        net.crash("server")
        with pytest.raises(TransportError, match="reset"):
            await fetch
        failed_at = loop.time()
        with pytest.raises(TransportError, match="refused"):
            await net.transport("client").get_chunk("sim://server", b"a", 1 << 20, 60.0, "client")
        assert net.network.active_flows() == []
        net.close()
        return failed_at, net.network.traffic.sent.get("server", 0.0), net.network.traffic.received.get("client", 0.0)

    failed_at, sent, received = run_virtual(main())
    assert failed_at == pytest.approx(0.52)
    assert sent == pytest.approx(500_000) and received == pytest.approx(500_000)  # the moved half counts


class _StockLoop(VirtualTimeLoop):
    """VirtualTimeLoop on asyncio's own scheduling code (its heap of handles, its ``_run_once``): the reference."""

    _LEAN = ("time",)  # the core's clock only
    call_soon = asyncio.SelectorEventLoop.call_soon  # type: ignore[assignment]
    call_at = asyncio.SelectorEventLoop.call_at  # type: ignore[assignment]
    call_later = asyncio.SelectorEventLoop.call_later  # type: ignore[assignment]
    _run_once = asyncio.SelectorEventLoop._run_once  # type: ignore[attr-defined]
    _timer_handle_cancelled = asyncio.SelectorEventLoop._timer_handle_cancelled  # type: ignore[attr-defined]

    def _jump(self, timeout: float) -> None:
        core = self._core
        target = core.now + timeout
        scheduled = self._scheduled  # type: ignore[attr-defined]
        if scheduled and abs(scheduled[0].when() - target) <= 1e-6 * max(1.0, abs(target)):
            target = scheduled[0].when()
        core.now = max(core.now, target)
        core.jumps += 1


@pytest.mark.parametrize("seed", range(4))
def test_callbacks_run_in_the_order_asyncio_runs_them(seed: int) -> None:
    """The loop's lean scheduling keeps asyncio's order exactly, ties and cancelled timers included (a
    simulation's result depends on the order of same-instant callbacks)."""
    import random

    async def main() -> list[tuple[float, int]]:
        rng = random.Random(seed)
        loop = asyncio.get_running_loop()
        seen: list[tuple[float, int]] = []
        timers: list[asyncio.TimerHandle] = []

        async def worker(i: int) -> None:
            for _ in range(30):
                await asyncio.sleep(rng.choice([0.0, 0.001, 0.001, 0.002, 0.0035]))  # many ties
                seen.append((loop.time(), i))
                if rng.random() < 0.3:
                    timers.append(loop.call_later(rng.choice([0.001, 0.002]), seen.append, (loop.time(), -i)))
                if timers and rng.random() < 0.2:
                    timers.pop(rng.randrange(len(timers))).cancel()
                if rng.random() < 0.1:
                    try:
                        async with asyncio.timeout(0.0015):
                            await asyncio.sleep(0.002)
                    except TimeoutError:
                        seen.append((loop.time(), 1000 + i))

        await asyncio.gather(*(worker(i) for i in range(60)))
        return seen

    def run(loop: VirtualTimeLoop) -> tuple[list[tuple[float, int]], int]:
        try:
            return loop.run_until_complete(main()), loop.jumps
        finally:
            loop.close()

    lean, stock = run(VirtualTimeLoop()), run(_StockLoop())
    assert len(lean[0]) > 1800
    assert lean == stock
