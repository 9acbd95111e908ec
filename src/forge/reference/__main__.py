"""Rewrite every generated page of docs/reference/, or with --check exit 1 naming the stale ones."""

import sys
from collections.abc import Callable
from pathlib import Path

from forge.config import help as config_help
from forge.config import support
from forge.reference import commands, presets

PAGES: dict[str, Callable[[], str]] = {
    "config.md": config_help.reference_page,
    "support.md": lambda: support.render(support.support_matrix()),
    "presets.md": presets.render,
    "cli.md": commands.render,
}
"""Each page of docs/reference/ and the function that writes it."""


def stale_pages(folder: Path) -> list[str]:
    return [name for name, render in PAGES.items() if (folder / name).read_text() != render()]


def main() -> None:
    folder = commands.ROOT / "docs" / "reference"
    if "--check" in sys.argv:
        stale = stale_pages(folder)
        if stale:
            print(f"stale generated pages in docs/reference: {', '.join(stale)} (run python -m forge.reference)")
        sys.exit(1 if stale else 0)
    for name, render in PAGES.items():
        (folder / name).write_text(render())


if __name__ == "__main__":
    main()
