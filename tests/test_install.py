"""A non-editable install (the wheel) carries conf/ and composes without the checkout."""

import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_wheel_ships_conf_and_runs_without_the_checkout(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("forge_train-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "forge/conf/train.yaml" in names and "forge/conf/model/llama_tiny.yaml" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Run from an unrelated folder with only the unpacked wheel on the path (ahead of the editable checkout).
    code = "import forge.config as c; print(c.conf_dir())"
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    env["PYTHONPATH"] = ":".join([str(site), *site_packages])
    where = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip() == str(site / "forge" / "conf")
    job = subprocess.run(
        [sys.executable, "-m", "forge.train", "--cfg", "job", "model=llama3_8b"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert job.returncode == 0, job.stderr
    assert "dim: 4096" in job.stdout
