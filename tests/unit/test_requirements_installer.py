"""The hosts' installer (client/_env_host): uv's one-line verdict, and uv over a layered environment.

uv reads only an environment's own site-packages, so ``_shadow_base`` shows it the base's
distributions as metadata while it installs. Here with the real uv (the ``test`` extra) and
a real virtualenv over this interpreter, offline: a wheel that needs PyYAML (this
interpreter's) installs only with the copies, and none of them stays.
"""

from __future__ import annotations

import subprocess
import venv
import zipfile
from pathlib import Path

from distrun.client import _env_host


def _wheel(folder: Path) -> None:
    """A wheel of ``needsyaml`` 1.0, which requires PyYAML."""
    folder.mkdir()
    info = "needsyaml-1.0.dist-info"
    with zipfile.ZipFile(folder / "needsyaml-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("needsyaml/__init__.py", "import yaml\n")
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: needsyaml\nVersion: 1.0\n"
                                             "Requires-Dist: PyYAML>=5\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")


def _install(uv: list[str], env: Path, wheels: Path) -> subprocess.CompletedProcess:
    return subprocess.run(uv + ["pip", "install", "--python", str(env / "bin" / "python"), "--no-index",
                                "--find-links", str(wheels), "needsyaml==1.0"],
                          capture_output=True, text=True, timeout=120)


def test_uv_installs_over_the_base_through_its_metadata_and_leaves_none_of_it(tmp_path: Path) -> None:
    uv = _env_host._find_uv("auto")
    assert uv is not None, "uv is in the test extra: pip install -e '.[test]'"
    assert _env_host._find_uv("pip") is None
    _wheel(tmp_path / "wheels")
    env = tmp_path / "env"
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(env)
    alone = _install(uv, env, tmp_path / "wheels")  # uv alone does not see the base's PyYAML
    assert alone.returncode != 0 and "pyyaml" in alone.stderr.lower(), alone.stderr
    line = _env_host._last_uv_error(alone.stderr)
    assert line.startswith("uv: No solution found when resolving dependencies: Because pyyaml was not found"), line

    made = _env_host._shadow_base(str(env))
    try:
        done = _install(uv, env, tmp_path / "wheels")
    finally:
        _env_host._unshadow(made)
    assert done.returncode == 0, done.stderr
    assert "+ needsyaml==1.0" in done.stderr and "pyyaml" not in done.stderr.lower().replace("needsyaml", ""), \
        done.stderr
    site = next(env.glob("lib/python*/site-packages"))
    assert sorted(path.name for path in site.glob("*.dist-info")) == ["needsyaml-1.0.dist-info"]
    imported = subprocess.run([str(env / "bin" / "python"), "-c", "import needsyaml, yaml; print(yaml.__file__)"],
                              capture_output=True, text=True, timeout=60, cwd="/")
    assert imported.returncode == 0 and str(env) not in imported.stdout, imported.stderr  # the base's PyYAML


def test_uvs_verdict_is_one_line_old_and_new_formats() -> None:
    new = ("Using Python 3.11.7 environment at: env\n"
           "error: No solution found when resolving dependencies\n"
           "  cause: Because nosuchpkg was not found in the provided package locations and you require "
           "nosuchpkg==3.1, we can conclude that your requirements are unsatisfiable.\n"
           "hint: look elsewhere\n")
    assert _env_host._last_uv_error(new) == (
        "uv: No solution found when resolving dependencies: Because nosuchpkg was not found in the provided "
        "package locations and you require nosuchpkg==3.1, we can conclude that your requirements are "
        "unsatisfiable.")
    old = ("  × No solution found when resolving dependencies:\n"
           "  ╰─▶ Because nosuchpkg was not found in the package registry and you require nosuchpkg==3.1, we can\n"
           "      conclude that your requirements are unsatisfiable.\n")
    assert _env_host._last_uv_error(old) == (
        "uv: No solution found when resolving dependencies: Because nosuchpkg was not found in the package "
        "registry and you require nosuchpkg==3.1, we can conclude that your requirements are unsatisfiable.")
    assert _env_host._last_uv_error("") == "uv: uv printed nothing"
