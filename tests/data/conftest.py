"""Small real inputs (Shakespeare scenes as jsonl, parquet and text files) and a prepare-config helper."""

import json
import subprocess
import sys

import pytest

from forge.data.embedded import read_scenes
from tests.conftest import ROOT


@pytest.fixture(scope="session")
def scenes() -> list[str]:
    return read_scenes()[:60]


@pytest.fixture
def inputs(tmp_path, scenes):
    """Three files holding the 60 scenes: 30 as jsonl, 20 as parquet, 10 as text files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    folder.mkdir()
    with (folder / "a.jsonl").open("w") as f:
        for scene in scenes[:30]:
            f.write(json.dumps({"text": scene, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": scenes[30:50]}), folder / "b.parquet")
    for i, scene in enumerate(scenes[50:]):
        (folder / f"c{i:02d}.txt").write_text(scene)
    return folder


def prepare_cmd(*overrides: str) -> subprocess.CompletedProcess:
    """forge-prepare-data as a user runs it (through this interpreter), without a progress bar."""
    cmd = [sys.executable, "-m", "forge.data.cli", "progress=false", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)


def prepare_config(**values):
    """The composed prepare config with `values` as overrides (for in-process calls of prepare())."""
    from forge.config import compose

    def render(value):
        return "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)

    return compose([f"{k}={render(v)}" for k, v in values.items()] + ["progress=false"], config_name="prepare")


@pytest.fixture
def prepared(tmp_path, inputs):
    """The 60 scenes prepared with GPT-2's BPE into shards of 7,000 tokens; returns the output folder."""
    from forge.data.prepare import prepare

    out = tmp_path / "prepared"
    prepare(prepare_config(inputs=[str(inputs / "*")], out_dir=str(out), shard_tokens=7000))
    return out
