"""Create the peers' virtualenvs and run their drivers, each scenario in a fresh database."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common import Settings, fresh_database, median, settle

HERE = Path(__file__).parent
MARK = "BENCH-RESULT "


@dataclass(frozen=True)
class Peer:
    """A library we compare with: what to install and which Python it needs."""

    name: str
    requirements: tuple[str, ...]
    min_python: tuple[int, int] = (3, 11)


PEERS = {
    "pgqueuer": Peer("pgqueuer", ("pgqueuer==1.6.0", "asyncpg", "psycopg[binary]")),
    "procrastinate": Peer("procrastinate", ("procrastinate==3.10.0", "psycopg[binary]")),
    "chancy": Peer("chancy", ("chancy==0.26.0", "psycopg[binary]")),
    "oban": Peer("oban", ("oban==0.7.0", "psycopg[binary]"), min_python=(3, 12)),
}


def cache_dir() -> Path:
    """Where the virtualenvs live (``$SKIPJACK_BENCH_CACHE`` overrides)."""
    base = os.environ.get("SKIPJACK_BENCH_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "skipjack-bench"


def find_python(version: tuple[int, int]) -> str | None:
    """A working Python interpreter of at least ``version``: this one, else pyenv's
    installed versions, else ``pythonX.Y`` on PATH (each is checked by running it)."""
    if sys.version_info[:2] >= version:
        return sys.executable
    candidates = sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.*/bin/python")),
                        reverse=True)
    candidates += [p for minor in range(20, version[1] - 1, -1)
                   if (p := shutil.which(f"python{version[0]}.{minor}"))]
    check = f"import sys; sys.exit(sys.version_info[:2] < {version!r})"
    for python in candidates:
        try:
            if subprocess.run([python, "-c", check], capture_output=True,
                              timeout=30).returncode == 0:
                return python
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def ensure_venv(peer: Peer, log: Any) -> Path:
    """The peer's virtualenv's python, creating the virtualenv if it is missing.

    Raises:
        RuntimeError: no suitable Python, or pip failed.
    """
    venv = cache_dir() / "venvs" / peer.name
    python = venv / "bin" / "python"
    marker = venv / ".skipjack-bench-requirements"
    wanted = "\n".join(peer.requirements)
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    base = find_python(peer.min_python)
    if base is None:
        raise RuntimeError(f"{peer.name} needs Python {'.'.join(map(str, peer.min_python))}+")
    log(f"creating the {peer.name} virtualenv in {venv}")
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, capture_output=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", *peer.requirements],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"pip install for {peer.name} failed: {done.stderr.strip()[-500:]}")
    marker.write_text(wanted)
    return python


def run_driver(python: Path, peer: str, params: dict[str, Any], timeout: float
               ) -> dict[str, Any]:
    """Run one scenario of a peer's driver; its result, or ``{"error": ...}``."""
    script = HERE / f"{peer}_driver.py"
    try:
        proc = subprocess.run([str(python), str(script), json.dumps(params)],
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            result: dict[str, Any] = json.loads(line[len(MARK):])
            return result
    return {"error": (proc.stderr or proc.stdout).strip()[-800:] or f"exit {proc.returncode}"}


def run_peer(settings: Settings, name: str, sizes: dict[str, dict[str, Any]]
             ) -> dict[str, Any]:
    """W1-W4 for one peer: each scenario ``settings.runs`` times in fresh databases."""
    peer = PEERS[name]
    try:
        python = ensure_venv(peer, settings.log)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}
    version = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        capture_output=True, text=True).stdout.strip()
    out: dict[str, Any] = {"version": version}
    for scenario, params in sizes.items():
        settings.log(f"{name}: {scenario} {params}")
        settle(settings.dsn)
        runs = []
        for _ in range(settings.runs):
            with fresh_database(settings.dsn, name) as dsn:
                runs.append(run_driver(python, name, {"scenario": scenario, "dsn": dsn,
                                                      **params}, timeout=300))
        out[scenario] = summarize(runs)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the numeric figures of the runs that succeeded, and every run."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return {"error": runs[0].get("error"), "runs": runs}
    summary: dict[str, Any] = {}
    for key, value in good[0].items():
        if isinstance(value, int | float) or value is None:
            summary[key] = median([r.get(key) for r in good])
    summary["runs"] = runs
    return summary
