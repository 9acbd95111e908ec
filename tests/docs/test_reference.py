"""The generated reference pages are current: the model presets (built on the meta device) and each command's
help. (The config fields and the support matrix have their own staleness tests in tests/config/.)"""

import pytest

from forge.reference import commands, presets
from tests.docs.pages import DOCS


def test_the_presets_page_is_current():
    assert (DOCS / "reference" / "presets.md").read_text() == presets.render(), "run python -m forge.reference"


def test_the_commands_page_is_current():
    page = (DOCS / "reference" / "cli.md").read_text()
    if f"by {commands.python_version()}'s argparse" not in page:
        pytest.skip(f"the page was generated under another Python than {commands.python_version()}")
    assert page == commands.render(), "run python -m forge.reference"
    for name in commands.scripts():
        assert f"$ {name} --help" in page
