"""The dashboard's page is offline (issue 50): the built wheel carries every asset the page loads,
and the page names no other origin. The suite runs from the source tree, so this builds the wheel a
user installs and reads it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

STATIC = REPO / "distrun" / "dashboard" / "static"


def test_the_wheel_carries_every_asset_and_the_page_loads_nothing_from_elsewhere(tmp_path: Path) -> None:
    # The installed setuptools builds it in a second; without one, pip fetches the build backend.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                            str(REPO), "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(tmp_path.glob("distrun-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assets = sorted(path.name for path in STATIC.iterdir() if path.is_file())
    assert {"index.html", "app.js", "charts.js", "style.css"} <= set(assets), assets
    missing = [name for name in assets if f"distrun/dashboard/static/{name}" not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    html = (STATIC / "index.html").read_text()
    loaded = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert loaded and all(ref.startswith("/") and not ref.startswith("//") for ref in loaded), loaded
    files = [ref for ref in loaded if ref.startswith("/static/")]  # the others are the page's own links
    assert len(files) >= 4 and all(ref.removeprefix("/static/") in assets for ref in files), (loaded, assets)
    for name in assets:  # no script or sheet reaches another origin
        text = (STATIC / name).read_text(errors="replace")
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), f"{name} names another origin"
