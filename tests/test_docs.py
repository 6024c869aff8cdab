"""The front page stays a front page, and the documentation's relative links lead somewhere: README.md
is at most 250 lines, and every relative link of README.md, docs/*.md and experiments/gpu/README.md
names a file or folder of the checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "experiments" / "gpu" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)  # not rendered: a placeholder there is no link yet


def relative_links(text: str) -> list[str]:
    """Link targets that point into the checkout: no scheme, no mail, no pure #anchor; code blocks and
    HTML comments skipped."""
    text = COMMENT.sub("", FENCE.sub("", text))
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t.split("#")[0] for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:|^#", t)]


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; the manuals belong in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert missing == []


def test_the_check_sees_a_broken_link():
    text = ("[ok](https://x.org) [anchor](#a) [bad](nowhere.md#s) ![img](img/a.png)\n```\n[in code](skip.md)\n```\n"
            "<!-- TODO\n![later](img/b.png) -->\n")
    assert relative_links(text) == ["nowhere.md", "img/a.png"]
