"""Files forge renames into place get the mode the umask gives a plain open() (not mkstemp's 0600), so a colleague
can read a shared run and cache: the checkpoint's COMPLETE and `latest`, the cached tokenizers and token arrays,
prepared shards and their meta.json, and the tiny vision encoder's folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WRITE_ALL = """
import json, os, sys
from pathlib import Path
from forge.checkpoint.layout import mark_complete
from forge.data.shards import ShardWriter, write_json_atomic
from forge.data.vlm.dataset import MediaRecord
from forge.data.vlm.sources import record_tokenizer
import numpy as np

out, full = Path(sys.argv[1]), sys.argv[2] == "full"
(out / "ckpt" / "step-00000001").mkdir(parents=True)
mark_complete(out / "ckpt", out / "ckpt" / "step-00000001")
record_tokenizer([MediaRecord("a.png", "what shape?", "a circle")] * 4, "bpe", 300, str(out / "cache"))
(out / "shards").mkdir()
write_json_atomic(out / "shards" / "meta.json", {"format": 1})
ShardWriter(out / "shards", np.dtype(np.uint16), 4).add(np.arange(4))
if full:
    from forge.config.schema import EmbeddedDataConfig, options
    from forge.data.embedded import EmbeddedCorpus
    from forge.models.vlm.encoder import build_tiny_encoder

    EmbeddedCorpus(**options(EmbeddedDataConfig, cache_dir=str(out / "cache")))
    build_tiny_encoder(out / "cache" / "encoder")
print(json.dumps({str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*")}))
"""


def modes_after_writing(folder: Path, umask: int, full: bool) -> dict[str, int]:
    """{relative path: permission bits} of everything the writers made under `folder`, run with `umask`."""
    result = subprocess.run(
        [sys.executable, "-c", WRITE_ALL, str(folder), "full" if full else "quick"],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.umask(umask),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize(("umask", "full"), [(0o022, False), (0o027, True)])
def test_written_files_get_the_umask_s_mode(tmp_path, umask, full):
    modes = modes_after_writing(tmp_path, umask, full)
    files = ["ckpt/latest", "ckpt/step-00000001/COMPLETE", "shards/meta.json", "shards/shard_00000.npy"]
    files += [name for name in modes if name.startswith("cache/vlm/bpe-")]
    if full:
        embedded = next(name for name in modes if name.startswith("cache/embedded/") and name.count("/") == 2)
        files += [f"{embedded}/{name}" for name in ("tokenizer.json", "train.npy", "val.npy")]
        assert modes["cache/encoder"] == 0o777 & ~umask
    assert len(files) == (8 if full else 5)
    assert {name: oct(modes[name]) for name in files} == {name: oct(0o666 & ~umask) for name in files}
    assert not [name for name in modes if ".tmp" in name], "a temporary file was left behind"
