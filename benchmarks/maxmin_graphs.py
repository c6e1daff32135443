"""How much of the links' capacity max-min sharing uses, by the shape of the flow graph.

    .venv/bin/python -m benchmarks.maxmin_graphs [--hosts 200] [--trials 3] [--seed 1]

Static graphs on the simulator's own network model (simulations/network.py, every host with an
uplink and a downlink of capacity 1, no latency): the rates are its from-scratch max-min
allocation (``Network.full_allocation``), and the figure is the sum of the rates over the hosts'
upload capacity.  Rows:

* ``random k``: k x hosts flows between random pairs (the flows per link vary);
* ``regular k``: every host sends exactly k flows and receives exactly k (k random permutations);
* ``placed k / cap c``: every host makes k requests, each placed with a random sender below c
  flows (a full sender is skipped, as a refused request goes elsewhere).

Used in docs/bandwidth-study.md section 4: the swarm's steady state (84% of capacity with 3-4 flows
per link) is what a random graph of that degree gives; regular graphs use all of it.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

from patchswarm.simulations.network import Host, Network, Region

Graph = list[tuple[int, int]]


def utilisation(n: int, flows: Graph) -> float:
    net = Network([Host(f"h{i}", "r", up=1.0, down=1.0) for i in range(n)], [Region("r", 0.0)], window=None)
    for src, dst in flows:
        net.add_flow(0.0, f"h{src}", f"h{dst}", 1e18)
    net.advance(0.0)
    return sum(net.full_allocation().values()) / n


def random_graph(n: int, k: int, rng: random.Random) -> Graph:
    out = []
    while len(out) < k * n:
        src, dst = rng.randrange(n), rng.randrange(n)
        if src != dst:
            out.append((src, dst))
    return out


def regular_graph(n: int, k: int, rng: random.Random) -> Graph:
    out = []
    for _ in range(k):
        perm = list(range(n))
        while any(perm[i] == i for i in range(n)):  # a derangement: nobody sends to itself
            rng.shuffle(perm)
        out += [(i, perm[i]) for i in range(n)]
    return out


def placed_graph(n: int, k: int, cap: int, rng: random.Random) -> Graph:
    load = [0] * n
    requests = [dst for dst in range(n) for _ in range(k)]
    rng.shuffle(requests)
    out = []
    for dst in requests:
        free = [s for s in range(n) if s != dst and load[s] < cap]
        if free:
            src = rng.choice(free)
            load[src] += 1
            out.append((src, dst))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=200)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    rows: list[tuple[str, Callable[[], Graph]]] = []
    for k in (1, 2, 3, 4, 6, 8):
        rows.append((f"random {k}", lambda k=k: random_graph(args.hosts, k, rng)))
    for k in (1, 2, 4, 8):
        rows.append((f"regular {k}", lambda k=k: regular_graph(args.hosts, k, rng)))
    for k, cap in ((3, 3), (4, 4), (6, 4), (4, 6)):
        rows.append((f"placed {k} / cap {cap}", lambda k=k, cap=cap: placed_graph(args.hosts, k, cap, rng)))
    print(f"{args.hosts} hosts, unit links, mean of {args.trials} graphs: max-min goodput / upload capacity")
    for name, make in rows:
        values = []
        flows_per_host = []
        for _ in range(args.trials):
            g = make()
            values.append(utilisation(args.hosts, g))
            flows_per_host.append(len(g) / args.hosts)
        print(f"  {name:<18} {statistics.mean(values):.3f}   ({statistics.mean(flows_per_host):.2f} flows per host)")


if __name__ == "__main__":
    main()
