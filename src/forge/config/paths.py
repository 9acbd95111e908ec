"""Where the `conf/` tree lives: inside the installed package, or at the top of a source checkout."""

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def conf_dir() -> Path:
    """The config tree: `forge/conf` in a wheel (shipped by the build), else the checkout's `conf/`."""
    for candidate in (_PACKAGE_DIR / "conf", _PACKAGE_DIR.parent.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"forge's conf/ was not found next to {_PACKAGE_DIR}; reinstall the package")
