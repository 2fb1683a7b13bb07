"""Install lines in the docs work from a clone: every ``pip install`` names paths that exist and
the pinned constraints, and a line naming an index package is marked as not available yet."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "docs" / "quickstart.md"]
INDEX_NAMES = re.compile(r"^qplug-[\w-]+$")


def _pip_lines(page: Path) -> list[str]:
    lines = []
    for line in page.read_text().splitlines():
        spans = re.findall(r"`([^`]*pip install[^`]*)`", line) or [line]  # inline code in prose
        for span in spans:
            for command in span.split("&&"):
                if "pip install" in command:
                    lines.append(command.strip().lstrip("$ ").strip())
    return lines


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_pip_install_lines_work_from_a_clone(page):
    lines = _pip_lines(page)
    assert lines, f"{page.name} shows no install command"
    for line in lines:
        code, _, comment = line.partition("#")
        words = shlex.split(code)[words_start(code):]
        if any(INDEX_NAMES.match(w) for w in words):
            assert "future" in comment or "not available" in comment, (
                f"{page.name}: {line!r} asks the package index for a qplug package that is not "
                "published; install from the clone or mark the line as future")
            continue
        assert "-c" in words and "constraints.txt" in words, f"{page.name}: {line!r} lacks the pin"
        for i, word in enumerate(words):
            if word == "-e":
                target = words[i + 1].split("[")[0].strip("\"'")
                assert (REPO / target).exists(), f"{page.name}: {line!r} installs missing {target}"


def words_start(code: str) -> int:
    """Index of the first word after ``pip install``."""
    words = shlex.split(code)
    return words.index("install") + 1
