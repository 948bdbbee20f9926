"""The entry point: rpc_registry finds the TENSORPIPE backend and picks it by default."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tpb_workers import free_port

from rpc_registry import ENTRY_POINT_GROUP, BackendPlugin
from tensorpipe_backend import PLUGIN, TensorPipeAgent, init_backend_handler

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


def _declared_entry_point() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split(f'[project.entry-points."{ENTRY_POINT_GROUP}"]', 1)[1]
    line = next(line for line in section.splitlines() if line.startswith("TENSORPIPE"))
    return line.split("=", 1)[1].strip().strip('"')


def test_declared_entry_point_loads_a_valid_plugin() -> None:
    entry = importlib.metadata.EntryPoint("TENSORPIPE", _declared_entry_point(), ENTRY_POINT_GROUP)
    loaded = entry.load()
    assert isinstance(loaded, BackendPlugin) and loaded.name == "TENSORPIPE"
    assert loaded is PLUGIN


def test_init_handler_rejects_foreign_options() -> None:
    match = r"^`rpc_backend_options` must be a `TensorPipeRpcBackendOptions` .*rpc_backend_options=<object"
    with pytest.raises(TypeError, match=match):
        init_backend_handler(None, "w0", 0, 1, object())  # type: ignore[arg-type]


def test_installed_distribution_is_the_default_backend(tmp_path: Path) -> None:
    info = tmp_path / "tensorpipe_backend-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorpipe-backend\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nTENSORPIPE = {_declared_entry_point()}\n")
    script = textwrap.dedent(
        """
        import warnings
        warnings.filterwarnings("ignore", "Failed to initialize NumPy")
        import torch
        import rpc_registry
        from tensorpipe_backend import TensorPipeAgent, get_current_agent
        rpc_registry.init_rpc("solo", rank=0, world_size=1)
        assert isinstance(get_current_agent(), TensorPipeAgent)
        two = rpc_registry.rpc_sync("solo", torch.add, args=(torch.ones(1), 1))
        assert torch.equal(two, torch.full((1,), 2.0))
        rpc_registry.shutdown()
        print("default-ok")
        """
    )
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TENSORPIPE_BACKEND_AUTH_TOKEN="t")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=50, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "default-ok" in result.stdout
    assert TensorPipeAgent.__module__ == "tensorpipe_backend.agent"


def test_rpc_registry_loads_the_backend_only_when_its_names_are_used() -> None:
    script = textwrap.dedent(
        """
        import sys
        import warnings
        warnings.filterwarnings("ignore", "Failed to initialize NumPy")
        import rpc_registry as rpc
        assert "tensorpipe_backend" not in sys.modules, "imported at import of rpc_registry"
        options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4)
        from tensorpipe_backend import TensorPipeAgent, TensorPipeRpcBackendOptions
        assert type(options) is TensorPipeRpcBackendOptions and options.num_worker_threads == 4
        assert rpc.TensorPipeAgent is TensorPipeAgent
        print("lazy-ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=50, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "lazy-ok" in result.stdout
