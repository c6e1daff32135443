"""A simulated run split between forked processes (simulations/partitioned.py), against the same run in one."""

from __future__ import annotations

import signal

import pytest

from patchswarm.simulations import partitioned
from patchswarm.simulations.network import Host, Network, Region
from patchswarm.simulations.runner import Churn
from patchswarm.simulations.synthetic import SyntheticRun, synthetic_setup
from tests.support.sim_streams import stream


@pytest.fixture(scope="module")
def synthetic() -> SyntheticRun:
    return synthetic_setup(patch_bytes=20_000_000, chunk_bytes=1 << 20, versions=2)


def test_a_partitioned_run_delivers_every_version_as_one_process_does(synthetic: SyntheticRun) -> None:
    one = stream(synthetic, n=16)
    two = stream(synthetic, n=16, partitions=2)
    for a, b in zip(one.versions, two.versions, strict=True):
        assert a.hosts_done == b.hosts_done == 16
        assert b.time_to_all == pytest.approx(a.time_to_all, rel=0.15)
        assert b.seed_egress <= 2 * a.payload_bytes  # the seed still sends about one copy, not one per host
    for row in two.rows:  # every host got every version, and its bytes add up to the patch
        assert row.done < float("inf")
        assert (
            row.from_seed + row.from_peers
            >= synthetic.board.manifest(synthetic.board.manifest_ids[row.version]).payload_size
        )
    assert two.messages.chunk_requests > 0 and two.messages.gossip_messages > 0 and two.events > 0
    assert set(two.marks) == {f"h{i:02d}" for i in range(16)} and all(two.marks.values())
    assert two.sent  # the flow model (in the parent) counted the bytes
    assert not two.errors


def test_a_partitioned_run_is_deterministic(synthetic: SyntheticRun) -> None:
    a = stream(synthetic, n=10, partitions=2)
    b = stream(synthetic, n=10, partitions=2)
    assert a.rows == b.rows and a.marks == b.marks
    three = stream(synthetic, n=10, partitions=3)
    assert all(v.hosts_done == 10 for v in three.versions)


def test_what_partitions_do_not_support_is_refused(synthetic: SyntheticRun) -> None:
    with pytest.raises(ValueError, match="churn"):
        stream(synthetic, n=4, partitions=2, churn=Churn(rate=0.1, downtime=1.0))
    with pytest.raises(ValueError, match="zero latency"):
        stream(synthetic, n=4, partitions=2, regions=[Region("r0", 0.0)])
    with pytest.raises(ValueError, match="partitions"):
        stream(synthetic, n=4, partitions=0)


def test_a_flow_may_be_added_late_while_its_activation_is_ahead() -> None:
    net = Network([Host("a", "r", up=100.0, down=100.0), Host("b", "r", up=100.0, down=100.0)], [Region("r", 1.0)])
    net.advance(0.5)
    flow = net.add_flow(0.0, "a", "b", 100.0)  # sent at 0, active at 1: still ahead of the network at 0.5
    assert [f.id for f in net.advance(10.0)] == [flow.id] and flow.done_at == pytest.approx(2.0)
    with pytest.raises(ValueError, match="turns active"):
        net.add_flow(8.0, "a", "b", 1.0)  # active at 9, but the network is at 10


def test_a_failing_partition_is_reported(synthetic: SyntheticRun, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(partitioned, "run_child", broken)  # (the forked children inherit the patch)
    with pytest.raises(RuntimeError, match="partition"):
        stream(synthetic, n=4, partitions=2)


def test_hosts_are_spread_evenly_with_the_seed_counted_as_work() -> None:
    hosts = [f"h{i}" for i in range(100)]
    owner = partitioned.assign("seed", hosts, 2)
    assert owner["seed"] == 0 and set(owner) == {"seed", *hosts}
    sizes = [sum(1 for h in hosts if owner[h] == p) for p in range(2)]
    assert sizes == [49, 51]  # the seed weighs 2 hosts of 100
    assert partitioned.assign("seed", hosts, 2) == owner
    assert sorted({owner[h] for h in hosts}) == [0, 1]


def test_windows_larger_than_the_pipes_do_not_wedge_the_processes(
    synthetic: SyntheticRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The parent sends window j + 2 while a child sends its report on j + 1: with both larger than the
    # socket's buffer, two blocking sends would wait for each other (a 10,000-host run did).
    monkeypatch.setattr(partitioned, "SOCKET_BUFFER", 1024)

    def wedged(signum: int, frame: object) -> None:
        raise TimeoutError("the processes wait for each other")

    before = signal.signal(signal.SIGALRM, wedged)
    signal.alarm(120)  # (a wedged run would otherwise hang the suite; this one takes seconds)
    try:
        r = stream(synthetic, n=48, partitions=2)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert all(v.hosts_done == 48 for v in r.versions)
