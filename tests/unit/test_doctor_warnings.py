"""`distrun doctor`'s warning about a data plane on a public address (gloo/NCCL are plaintext), and
the installer it names for each host."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from distrun.client.doctor import _public
from distrun.server._doctor import installer_here


@pytest.mark.parametrize("address, public", [("10.199.0.11", None), ("192.168.1.4", None), ("127.0.0.1", None),
                                              ("fe80::1", None), ("8.8.8.8", "8.8.8.8"), ("2001:4860::8888", "2001:4860::8888"),
                                              (None, None), ("gpu-1", None)])
def test_doctor_calls_a_globally_routable_data_plane_address_public(address: object, public: str | None) -> None:
    assert _public(address) == public


def test_doctor_names_the_installer_that_built_the_environment_else_the_one_installer_resolves_to(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = tmp_path / ".envs" / "0123456789abcdef"
    (env / "bin").mkdir(parents=True)
    (env / ".distrun-ready").write_text(json.dumps({"name": env.name, "installer": "uv 0.9.2"}))
    assert installer_here(str(env / "bin" / "python"), "pip") == "uv 0.9.2"  # what built it, whatever is asked now
    base = tmp_path / "base" / "bin"
    base.mkdir(parents=True)
    assert installer_here(str(base / "python"), "pip") == "pip"
    # No uv anywhere (PATH empty, none beside the python, no uv package): auto is pip; uv is none.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "uv", None)
    assert installer_here(str(base / "python"), "auto") == "pip"
    assert installer_here(str(base / "python"), "uv") is None
    # A uv beside the host's python: auto and uv both resolve to it, with its version.
    fake = base / "uv"
    fake.write_text("#!/bin/sh\necho 'uv 0.4.1 (abc 2024-01-01)'\n")
    fake.chmod(0o755)
    assert installer_here(str(base / "python"), "auto") == installer_here(str(base / "python"), "uv") == "uv 0.4.1"
