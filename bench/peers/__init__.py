"""The peers benchmark: the same RPC workloads on ours, torch's RPC, Ray actors and Monarch actors.

    python3 tools/dev.py bench --peers [--rounds N] [--quick]

Each peer runs in its own virtual environment (:mod:`bench_peers.environments`)
and its own fresh processes on 127.0.0.1 each round (:mod:`bench_peers.runner`);
a peer's module (:mod:`bench_peers.rpc_api`, :mod:`bench_peers.ray_actors`,
:mod:`bench_peers.monarch_actors`) adapts it to the workloads of
:mod:`bench_peers.workloads`, and :mod:`bench_peers.report` writes
bench/results-peers.md and bench/results-peers.png.
"""
