"""The documentation site builds with MkDocs in strict mode (no broken link, no docstring
that mkdocstrings cannot read), and its API reference is generated from the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

pytest.importorskip("mkdocs")


def test_the_site_builds_strictly_with_the_api_reference(tmp_path: Path) -> None:
    # no -q: in MkDocs 1.6 it hides the warnings, and then --strict has none to count
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("JobHandle", "result_async", "enqueue_on", "drain", "job_transactions",
                 "SkipjackBackend"):
        assert name in reference, name
    for page in ("guides/django", "deployment", "changelog", "concepts", "tasks", "enqueueing",
                 "operations", "reliability"):
        assert (tmp_path / "site" / page / "index.html").exists(), page
