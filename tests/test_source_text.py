"""The source quotes no one machine's timings: numbers measured on a machine live beside the benchmark that makes
them (benchmarks/), where they are rerun, not in docstrings and comments where they go stale."""

import re
from pathlib import Path

import forge

SRC = Path(forge.__file__).parent
MACHINE_TIMING = re.compile(r"\b\d+(\.\d+)? ?(ms|µs)\b|EPYC|Xeon|\b\d+-core\b|measured here|on this machine", re.I)


def test_no_source_file_quotes_a_machines_timing():
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if MACHINE_TIMING.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_check_finds_a_timing():
    assert MACHINE_TIMING.search("# 2048 x 8192 logits on a 2-core EPYC: 37 ms forward")
    assert not MACHINE_TIMING.search("# a chunk of 4 MiB rows, 3x the forward")
