"""The loss curves of the default model, the default MoE and a VLM strategy are the recorded ones.

A refactor that changes no behaviour leaves every curve within the recorded tolerance (another CPU's rounding,
measured by tests/golden/regenerate.py); a change of the learning rate by 1 % already moves each curve by many
tolerances. Regenerate with `python -m tests.golden.regenerate` and say why in the commit.
"""

import json

import pytest

from tests.golden.cases import CASES, GOLDEN, run_case

RECORDED = json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("name", list(CASES))
def test_curve_is_the_recorded_one(name):
    golden = RECORDED[name]
    run = run_case(name)
    for key in ("loss", "val_loss"):
        assert len(run[key]) == len(golden[key]), key
        worst = max(abs(a - b) for a, b in zip(run[key], golden[key], strict=True))
        assert worst <= golden["tolerance"], (
            f"{name} {key} moved by {worst:.3g} (tolerance {golden['tolerance']:.3g}):\n"
            f"recorded {golden[key]}\nnow      {run[key]}"
        )


def test_every_case_is_recorded_with_a_tolerance_that_sees_a_real_change():
    assert set(RECORDED) == set(CASES)
    for name, golden in RECORDED.items():
        assert golden["lr_plus_1_percent_difference"] >= 3 * golden["tolerance"] > 0, name
