"""The docs site's pages, read the way the site reads them: the nav of mkdocs.yml, and the links between pages."""

import re

import yaml

from tests.conftest import ROOT

DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, in order, relative to docs/."""
    pages: list[str] = []

    def walk(node) -> None:
        if isinstance(node, str):
            pages.append(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)

    walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    return pages


def all_pages() -> list[str]:
    return sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))


def links(page: str) -> set[str]:
    """The docs pages a page links to, relative to docs/ (links leaving docs/ are left out)."""
    found = set()
    for target in LINK.findall((DOCS / page).read_text()):
        if "://" in target:
            continue
        resolved = (DOCS / page).parent.joinpath(target).resolve()
        if resolved.is_relative_to(DOCS.resolve()):
            found.add(str(resolved.relative_to(DOCS.resolve())))
    return found


def table_cells(text: str) -> list[str]:
    """Every cell of every Markdown table row (code blocks left out)."""
    cells, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.lstrip().startswith("|"):
            cells += [cell.strip() for cell in line.strip().strip("|").split("|")]
    return cells
