"""The manual's and the results' relative links lead to files that exist, and results folders hold results: a script
that produced one lives in tools/ (lasting) or in git (a folder's one-off, named by ``git show COMMIT:PATH``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "tools" / "README.md",
            *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]


def broken_links(page: Path) -> list:
    """Relative links of ``page`` (anchors dropped) whose target does not exist."""
    missing = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    return missing


def test_every_relative_link_leads_to_a_file():
    broken = {str(page.relative_to(ROOT)): links for page in pages() if (links := broken_links(page))}
    assert broken == {}


def test_the_check_finds_a_missing_target(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[here](here.md) [gone](gone.txt#part) [web](https://example.org) [top](#top)")
    (tmp_path / "here.md").write_text("")
    assert broken_links(page) == ["gone.txt#part"]


def test_results_folders_hold_no_scripts():
    scripts = [str(path.relative_to(ROOT)) for path in (ROOT / "benchmarks" / "results").rglob("*")
               if path.suffix in (".py", ".sh")]
    assert scripts == []
