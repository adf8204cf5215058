"""The library and the tools are separate distributions: the library never imports the demo,
chaos or the benchmarks, its wheel does not ship them, and its command line loads their
commands only when they are invoked."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from skipjack.cli import main, parse_duration

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("pgqueuer", "procrastinate", "oban", "chancy")
TOOL_MODULES = ("skipjack_tools", "skipjack.bench", "skipjack.demo", "skipjack.chaos")
THIRD_PARTY = (*PEERS, "matplotlib")

# Run in a fresh interpreter: print the modules loaded after the statements given.
MODULES_AFTER = textwrap.dedent("""
    import json, sys
    {statements}
    print(json.dumps(sorted(sys.modules)))
""")

# Run the command line in a fresh interpreter in which skipjack_tools cannot be imported, as
# where only the library is installed.
WITHOUT_TOOLS = textwrap.dedent("""
    import sys

    class NoTools:
        def find_spec(self, name, path=None, target=None):
            if name == "skipjack_tools" or name.startswith("skipjack_tools."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTools())
    sys.argv = ["skipjack", *sys.argv[1:]]
    from skipjack.cli import run
    run()
""")


def _modules_after(*statements: str) -> set[str]:
    code = MODULES_AFTER.format(statements="\n".join(statements))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))  # the last line: after any help


def _tool_modules(modules: set[str]) -> list[str]:
    return sorted(m for m in modules
                  if any(m == t or m.startswith(t + ".") for t in TOOL_MODULES)
                  or m.split(".")[0] in THIRD_PARTY)


def _is_tool_file(name: str) -> bool:
    path = Path(name)
    return (bool({"bench", "peers", "skipjack_tools"} & set(path.parts[:-1]))
            or path.stem in ("bench", "peers", "demo", "chaos"))


def test_importing_the_library_and_its_cli_loads_no_tool_module() -> None:
    modules = _modules_after("import skipjack", "import skipjack.cli")
    assert {"skipjack", "skipjack.cli", "skipjack.runtime.worker", "click"} <= modules
    assert _tool_modules(modules) == []


def test_the_observability_extras_are_imported_only_when_used() -> None:
    """Without a metrics port or a tracing hook, neither prometheus_client nor OpenTelemetry
    is imported (they are optional extras: `pip install skipjack` does not bring them)."""
    modules = _modules_after("import skipjack", "import skipjack.cli",
                             "import skipjack.runtime.health")
    assert not any(m.split(".")[0] in ("prometheus_client", "opentelemetry") for m in modules)
    assert {"prometheus_client", "opentelemetry"} <= {
        m.split(".")[0] for m in _modules_after("import skipjack.metrics",
                                                "import skipjack.tracing")}


def test_the_framework_extras_are_imported_only_when_used() -> None:
    """The library and its command line import no framework (Django, SQLAlchemy, Starlette):
    `pip install skipjack` brings none of them."""
    modules = _modules_after("import skipjack", "import skipjack.cli", "import skipjack.testing",
                             "import skipjack.contrib.starlette")
    frameworks = {"django", "sqlalchemy", "starlette", "fastapi", "flask", "asgiref"}
    assert {m.split(".")[0] for m in modules} & frameworks == set()


def test_the_command_list_of_help_loads_no_tool_module() -> None:
    modules = _modules_after(
        "from skipjack.cli import main",
        "try:\n    main(['--help'], prog_name='skipjack')\nexcept SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code",
    )
    assert _tool_modules(modules) == []


def test_the_library_wheel_ships_no_tool(tmp_path: Path) -> None:
    # build from a copy holding only what the wheel is made of, so that a build/ or egg-info
    # left in the checkout cannot add to it
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    wheels = list(out.glob("skipjack-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
        sources = {n: wheel.read(n).decode() for n in names if n.endswith(".py")}
        metadata = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert {"skipjack/__init__.py", "skipjack/cli.py", "skipjack/runtime/worker.py",
            "skipjack/py.typed"} <= set(names)
    assert any(n.startswith("skipjack/migrations/") and n.endswith(".sql") for n in names)
    assert [n for n in names if _is_tool_file(n)] == []
    peer = re.compile(r"\b(?:" + "|".join(PEERS) + r")\b|_driver\b", re.IGNORECASE)
    assert [n for n in names if peer.search(n)] == []
    assert [n for n, text in sources.items() if peer.search(text)] == []
    assert "Provides-Extra: bench" not in metadata
    assert "matplotlib" not in metadata


@pytest.mark.parametrize(("command", "options"), [
    ("bench", ["--compare", "--only", "--scale", "--runs", "--quick", "--plot", "--no-plot",
               "--json", "--output"]),
    ("demo", ["--jobs", "--concurrency", "--fail-rate", "--json"]),
    ("chaos", ["--jobs", "--workers", "--concurrency", "--duration-ms", "--kill-every",
               "--stall-every", "--restart-db-every", "--terminate-backends-every",
               "--restart-cmd", "--lease", "--seed", "--timeout", "--json"]),
])
def test_tool_command_help_loads_the_tools(command: str, options: list[str]) -> None:
    result = CliRunner().invoke(main, [command, "--help"], prog_name="skipjack")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: skipjack {command} [OPTIONS]")
    assert [o for o in options if o not in result.output] == []


def test_tool_command_help_in_a_fresh_process() -> None:
    done = subprocess.run([sys.executable, "-m", "skipjack", "bench", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--compare" in done.stdout and "--quick" in done.stdout


@pytest.mark.parametrize("args", [["bench", "--help"], ["demo", "--jobs", "1"], ["chaos"]])
def test_tool_command_without_the_tools_says_how_to_install_them(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_TOOLS, *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    assert f"`skipjack {args[0]}` is part of skipjack-tools" in done.stderr
    assert "pip install ./tools" in done.stderr


def test_help_without_the_tools_still_lists_every_command() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_TOOLS, "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    listed = re.findall(r"^  (\w+) ", done.stdout.split("Commands:")[1], re.MULTILINE)
    assert listed == ["bench", "chaos", "cron", "dashboard", "demo", "embedded", "jobs", "metrics",
                      "migrate", "prune", "queues", "roles", "stats", "worker", "workers"]


@pytest.mark.parametrize(("text", "seconds"), [
    ("500ms", 0.5), ("2s", 2.0), ("5m", 300.0), ("12h", 43200.0), ("7d", 604800.0),
    ("90", 90.0), (" 1.5S ", 1.5),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5 minutes", "ms"])
def test_parse_duration_refuses_what_is_not_a_duration(text: str) -> None:
    with pytest.raises(click.BadParameter, match="is not a duration"):
        parse_duration(text)
