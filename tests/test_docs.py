"""The user documentation: the README stays a front page, every relative link of README.md and
docs/ points at a file of the repository, and no page tells the project's history by issue."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
"""the target of a Markdown link or image: ``[text](target)``"""


def _targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code are not links
    return [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_files(page):
    broken = []
    for target in _targets(page):
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_issue_numbers(page):
    found = re.findall(r"\bissues? #?\d+\b|#\d{2,}\b", page.read_text(), flags=re.I)
    assert not found, f"{page.relative_to(ROOT)} names issues {found}: say what, not which ticket"


def test_every_docs_page_is_reachable_from_the_readme():
    linked = set()
    for page in PAGES:
        for target in _targets(page):
            path = (page.parent / target.split("#", 1)[0]).resolve()
            linked.add(path)
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages no page links to: {orphans}"


FOLDERS = ("trainer", "vlm", "vla", "sim", "rewards", "datasets", "bench", "assets", "configs",
           "tests", "docs")  # fmt: skip
PATH = re.compile(rf"`((?:{'|'.join(FOLDERS)})/[\w./-]+\.(?:py|yaml|md|json))`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_files_named_in_code_spans_exist(page):
    """A page that names ``vlm/builder.py`` or ``configs/vlm_clevr.yaml`` names a file that is
    there (a rename that forgot a page fails here)."""
    missing = sorted({p for p in PATH.findall(page.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"
