"""Install one package alone, the ways the README documents, into clean environments.

Each way gets a fresh virtual environment that sees nothing but torch (from
.venvs/torch, so torch is not downloaded again) and must end with the
package importable and ``pip check`` content:

- from a checkout: ``pip install ./packages/join-core ./packages/ddp-join``,
  and lightning-join the same way (Lightning itself from the index)
- from a wheelhouse: ``python3 tools/dev.py wheels`` then
  ``pip install --find-links dist/wheels tensorpipe-backend`` (here with
  ``--no-index``, so that nothing but the wheelhouse can answer)
- from the git URL: ``pip install "join-core @ git+URL#subdirectory=..."
  "ddp-join @ git+URL#subdirectory=..."`` (here the URL of this checkout, at
  its last commit)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dev

ROOT = dev.ROOT


def attempt(title: str, install: list[str], probe: str) -> bool:
    """Install into a clean environment, then import; True if both worked."""
    print(f"install: {title}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        python = dev.torch_only_env(Path(tmp) / "env")
        steps = [
            [str(python), "-m", "pip", "install", "-q", *install],
            [str(python), "-m", "pip", "check"],
            [str(python), "-c", probe],
        ]
        for cmd in steps:
            result = subprocess.run(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if result.returncode != 0:
                print(result.stdout)
                print(f"install: {title}: FAILED: {' '.join(cmd[1:])} (exit {result.returncode})")
                return False
    return True


def main() -> int:
    ok = attempt(
        "ddp-join from a checkout",
        [str(ROOT / "packages" / "join-core"), str(ROOT / "packages" / "ddp-join")],
        "import ddp_join, join_core; print(ddp_join.DistributedDataParallel.__name__)",
    )
    ok &= attempt(
        "lightning-join from a checkout (lightning from the index)",
        [str(ROOT / "packages" / name) for name in ("join-core", "ddp-join", "lightning-join")],
        "import lightning_join; print(lightning_join.JoinDDPStrategy.__name__)",
    )
    with tempfile.TemporaryDirectory() as wheelhouse:
        if dev.build_wheels(Path(sys.executable), Path(wheelhouse)) != 0:
            return 1
        ok &= attempt(
            "tensorpipe-backend from a wheelhouse",
            ["--no-index", "--find-links", wheelhouse, "tensorpipe-backend"],
            "import rpc_registry; print(rpc_registry.BackendType.TENSORPIPE)",
        )
    if shutil.which("git") and (ROOT / ".git").exists():
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True
        ).stdout.strip()
        # localhost: the pip of Python 3.10-3.11 rejects file:/// (no host) in a "name @ URL".
        url = f"git+file://localhost{ROOT.as_posix()}@{commit}"
        ok &= attempt(
            "ddp-join from the git URL",
            [f"{name} @ {url}#subdirectory=packages/{name}" for name in ("join-core", "ddp-join")],
            "import ddp_join",
        )
    else:
        print("install: from the git URL: skipped (not a git checkout)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
