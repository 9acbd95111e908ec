import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("FORGE_CACHE_DIR", str(Path.home() / ".cache" / "forge"))


@pytest.fixture(scope="session")
def corpus():
    """The embedded corpus with the default 8k BPE (prepared once, cached)."""
    from forge.data.embedded import EmbeddedCorpus

    return EmbeddedCorpus("bpe8k", 8192, os.environ["FORGE_CACHE_DIR"])


def forge_cmd(*args: str) -> list[str]:
    """The forge-train command line, run with this interpreter."""
    return [sys.executable, "-m", "forge.train", *args]
