"""The docs site builds in strict mode (a broken link, a missing page or a page left out of the nav fails), every
page is reachable from the index, and the pages read as documentation: no session, issue number or date outside the
log, no table cell longer than 300 characters."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.docs.pages import DOCS, all_pages, links, nav_pages, table_cells

LOG = "log.md"
"""The dated lab notebook: the one page that may name sessions, issues and dates."""

DIARY = re.compile(r"\b[Ss]ession\b|\b[Ii]ssue \d|(?<![\w&])#\d|\b20\d\d-\d\d-\d\d")


def test_mkdocs_builds_strict(tmp_path):
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert done.returncode == 0 and not warnings, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "presets" / "index.html").exists()


def test_every_page_is_in_the_nav_and_reachable_from_the_index():
    nav = nav_pages()
    assert nav[0] == "index.md"
    assert sorted(nav) == all_pages(), "pages missing from mkdocs.yml's nav, or nav entries without a page"
    reached, frontier = {"index.md"}, ["index.md"]
    while frontier:
        for target in links(frontier.pop()) - reached:
            assert (DOCS / target).exists(), f"a link to {target}, which does not exist"
            reached.add(target)
            frontier.append(target)
    assert reached == set(all_pages()), f"not reachable from index.md by links: {set(all_pages()) - reached}"


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{p}" for p in all_pages() if p != LOG)])
def test_a_page_quotes_no_session_issue_or_date(page):
    hits = [line for line in (ROOT / page).read_text().splitlines() if DIARY.search(line)]
    assert not hits, f"{page} reads like a diary (move it to docs/{LOG}):\n" + "\n".join(hits[:5])


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{p}" for p in all_pages())])
def test_no_table_cell_is_longer_than_300_characters(page):
    longest = max(table_cells((ROOT / page).read_text()), key=len, default="")
    assert len(longest) <= 300, f"{page}: a {len(longest)}-character cell: {longest[:120]}..."
