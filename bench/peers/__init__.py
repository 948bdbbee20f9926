"""The peers benchmark: the same RPC workloads on ours, torch's RPC, Ray actors and Monarch actors.

    python3 tools/dev.py bench --peers [--rounds N] [--quick]

Each peer runs in its own virtual environment (:mod:`peers.environments`)
and its own fresh processes on 127.0.0.1 each round (:mod:`peers.runner`);
a peer's module (:mod:`peers.rpc_api`, :mod:`peers.ray_actors`,
:mod:`peers.monarch_actors`) adapts it to the workloads of
:mod:`peers.workloads`, and :mod:`peers.report` writes
bench/results-peers.md and bench/results-peers.png.
"""
