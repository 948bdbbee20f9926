"""An experiment: rpc_sync with the framing of small frames in C, against ours in pure Python.

    PYTHONPATH=packages/join-core/src:packages/rpc-registry/src:packages/tensorpipe-backend/src:bench \
        python bench/bench_framing_c.py [--rounds N] [--quick]

``bench/framing_c/framing.c`` is compiled here with Python's own compiler
settings (``sysconfig``) and, in both processes of a pair, put in place of
the three Python functions that frame a no-op call and its reply: the
request's send (``Connection.write``), the callee's read
(``FrameReader.read_frame``) and the caller's read of its own reply
(``FrameReader.take_reply``); everything else (pickling, the table of calls
in flight, deadlines, the reader threads) stays as it is. Each round starts
a fresh pair and alternates the two within it, with a raw TCP round trip
between the same processes beside them. The answer it gives is whether a
compiled extension for framing would be worth shipping (see
tensorpipe-backend's PERFORMANCE.md); where no C compiler or Python headers
are found the figures say so.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import shlex
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from bench_rpc import _free_port, _raw_servers, noop
from benchlib import Figure

from join_core.testing import run_ranks

__all__ = ["build", "framing_c_figures"]

SOURCE: Final = Path(__file__).resolve().parent / "framing_c" / "framing.c"
MODULE: Final = "tpb_framing_c"
_CALLS: Final = 1000
_WARMUP: Final = 200


def build(folder: Path) -> str | None:
    """Compile the extension into ``folder``; ``None``, or why it could not be built."""
    compiler = shlex.split(sysconfig.get_config_var("CC") or "cc")
    target = folder / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    command = [
        *compiler,
        "-O2",
        "-shared",
        "-fPIC",
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        "-o",
        str(target),
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"no C extension: {' '.join(command[:1])} failed: {detail.strip()[:200]}"
    return None


class _Framing:
    """Puts the C functions of ``module`` in place of tensorpipe_backend's Python ones, and back."""

    def __init__(self, module: ModuleType) -> None:
        from tensorpipe_backend.connection import SMALL_PAYLOAD, Connection
        from tensorpipe_backend.wire import _KINDS, HEADER, FrameHeader, FrameReader

        take, next_small, send = module.take_reply, module.next_small, module.send_small
        python_take, python_read, python_write = (
            FrameReader.take_reply,
            FrameReader.read_frame,
            Connection.write,
        )
        header_size = HEADER.size

        def take_reply(self: FrameReader, msg_id: int) -> Any:
            if self._end > self._start:
                return python_take(self, msg_id)
            taken = take(self._sock.fileno(), msg_id, self._peek)
            if taken is True:
                return True
            if taken is False:
                return python_take(self, msg_id)  # another frame, or one with tensors: Python decides
            kind, payload = taken
            self.received += header_size + len(payload)
            return _KINDS[kind], payload, []

        def read_frame(self: FrameReader) -> Any:
            frame = next_small(self._buffer, self._start, self._end)
            if frame is None:
                return python_read(self)
            kind, msg_id, payload, self._start = frame
            return FrameHeader(_KINDS[kind], msg_id, len(payload), 0, 0), [], payload

        def write(
            self: Connection, kind: Any, msg_id: int, payload: bytes, prepared: Any, *rest: Any
        ) -> None:
            if prepared or len(payload) > SMALL_PAYLOAD:
                python_write(self, kind, msg_id, payload, prepared, *rest)
                return
            with self.send_lock:
                if self.closed:
                    raise ConnectionError(f"the connection to {self.peer.name} is closed")
                send(self.sock.fileno(), int(kind), msg_id, payload)

        self._classes = (FrameReader, FrameReader, Connection)
        self._python = (python_take, python_read, python_write)
        self._c = (take_reply, read_frame, write)

    def use(self, c: bool) -> None:
        for cls, name, function in zip(
            self._classes, ("take_reply", "read_frame", "write"), self._c if c else self._python
        ):
            setattr(cls, name, function)


_framing: list[_Framing] = []


def use_c(c: bool) -> None:
    """Called on the callee: switch its framing to C (``True``) or Python."""
    _framing[0].use(c)


def _latencies_us(call: Any) -> list[float]:
    gc.collect()
    out = []
    for _ in range(_CALLS):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1e6)
    return out


def _raw(sock: socket.socket) -> None:
    sock.sendall(b"x")
    sock.recv(64)


def _measure(rank: int, world_size: int, folder: str, port: int, turns: int) -> dict[str, list[float]]:
    """Per-call microseconds of rpc_sync with each framing, and of a raw TCP round trip."""
    import torch.distributed as dist

    import rpc_registry as api
    from tensorpipe_backend import TensorPipeRpcBackendOptions

    sys.path.insert(0, folder)
    _framing.append(_Framing(importlib.import_module(MODULE)))
    addresses: list[Any] = [None, None]
    dist.all_gather_object(addresses, _raw_servers() if rank == 1 else None)
    options = TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    api.init_rpc(f"w{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    out: dict[str, list[float]] = {"python": [], "c": [], "raw": []}
    if rank == 0:
        raw = socket.create_connection(("127.0.0.1", addresses[1][0]))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(_WARMUP):
            api.rpc_sync("w1", noop)
        for turn in range(turns):
            for mode in ("c", "python") if turn % 2 else ("python", "c"):
                api.rpc_sync("w1", use_c, args=(mode == "c",))
                use_c(mode == "c")
                for _ in range(_WARMUP):
                    api.rpc_sync("w1", noop)
                out[mode] += _latencies_us(lambda: api.rpc_sync("w1", noop))
            out["raw"] += _latencies_us(lambda: _raw(raw))
        api.rpc_sync("w1", use_c, args=(False,))
        raw.close()
    api.shutdown()
    return out


def _p(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def framing_c_figures(rounds: int, quick: bool) -> list[Figure]:
    """rpc_sync p50 and p99 with the framing in C against pure Python, and against a raw round trip."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1 round")
    names = ("rpc_sync no-op p50, framing in C (experiment)", "rpc_sync no-op p99, framing in C (experiment)")
    with tempfile.TemporaryDirectory(prefix="framing-c-") as folder:
        failure = build(Path(folder))
        if failure is not None:
            nan = float("nan")
            return [Figure(name, "us", nan, nan, "(context)", nan, True, reference=failure) for name in names]
        samples: dict[str, list[float]] = {"python": [], "c": [], "raw": []}
        for _ in range(rounds):
            result = run_ranks(_measure, 2, folder, _free_port(), 2 if quick else 6, timeout=300)[0]
            for key, values in result.items():
                samples[key] += values
    figures = []
    for name, q in zip(names, (0.5, 0.99)):
        c, python, raw = (_p(samples[key], q) for key in ("c", "python", "raw"))
        figures.append(
            Figure(name, "us", c, python, "(context)", c / python, True, reference="ours in Python")
        )
        figures.append(
            Figure(
                name.replace("(experiment)", "vs raw TCP"),
                "us",
                c,
                raw,
                "<= 1.5x" if q == 0.5 else "<= 2x",
                c / raw,
                c <= (1.5 if q == 0.5 else 2.0) * raw,
                reference="raw TCP",
            )
        )
    return figures


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    for f in framing_c_figures(args.rounds, args.quick):
        print(f"{f.name:55s} {f.ours:8.1f} us  {f.reference}: {f.torch:8.1f} us  {f.ratio:.2f}x  {f.goal}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
