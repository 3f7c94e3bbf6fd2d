"""``requirements:`` as a pyproject.toml or a uv.lock (config/_requirements): the lines, the hash, bad files.

No hosts: the cluster file is parsed as `up` parses it, and the plan hashed as `up` hashes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distrun.client._environment import plan_environment
from distrun.config import parse_cluster
from distrun.errors import ConfigError
from tests.conftest import run_cli

PYPROJECT = """
[project]
name = "Trainer"
version = "0.1"
dependencies = ["clickutil==1.0", "einops>=0.7"]

[project.optional-dependencies]
gpu = ["nvidia-ml-py>=12"]
log = ["rich"]
all = ["trainer[gpu,log]", "tqdm"]
"""

UV_LOCK = """
version = 1
requires-python = ">=3.10"

[[package]]
name = "trainer"
version = "0.1"
source = { editable = "." }
dependencies = [
    { name = "clickutil" },
    { name = "colorama", marker = "sys_platform == 'win32'" },
    { name = "numpy", version = "1.26.4", source = { registry = "https://pypi.org/simple" }, marker = "python_version < '3.12'" },
    { name = "numpy", version = "2.1.0", source = { registry = "https://pypi.org/simple" }, marker = "python_version >= '3.12'" },
]

[package.optional-dependencies]
git = [{ name = "nvml" }]

[package.dev-dependencies]
dev = [{ name = "pytest" }]

[[package]]
name = "clickutil"
version = "1.0"
source = { registry = "https://pypi.org/simple" }
dependencies = [{ name = "colorama" }]

[[package]]
name = "colorama"
version = "0.4.6"
source = { registry = "https://pypi.org/simple" }
dependencies = [{ name = "winonly", marker = "sys_platform == 'win32'" }]

[[package]]
name = "winonly"
version = "2"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "numpy"
version = "1.26.4"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "numpy"
version = "2.1.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "nvml"
version = "12"
source = { git = "https://github.com/example/nvml?rev=main#abc123" }

[[package]]
name = "pytest"
version = "8.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "wheelonly"
version = "3"
source = { path = "wheels/wheelonly-3-py3-none-any.whl" }
"""


def _requirements(folder: Path, value: str) -> tuple[str, ...]:
    spec = parse_cluster(f"requirements: {value}\nhosts: [h1]\n", "c.yaml", folder).environment
    assert spec is not None
    return spec.requirements


def _error(folder: Path, value: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_cluster(f"requirements: {value}\nhosts: [h1]\n", "c.yaml", folder)
    return str(caught.value)


def test_a_pyproject_gives_its_dependencies_and_the_extras_asked_for(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    assert _requirements(tmp_path, "pyproject.toml") == ("clickutil==1.0", "einops>=0.7")
    assert _requirements(tmp_path, "{file: pyproject.toml, extras: [gpu]}") == (
        "clickutil==1.0", "einops>=0.7", "nvidia-ml-py>=12")
    # `all` names the project's own extras: expanded, the project itself never a requirement.
    assert _requirements(tmp_path, "{file: pyproject.toml, extras: [all]}") == (
        "clickutil==1.0", "einops>=0.7", "tqdm", "nvidia-ml-py>=12", "rich")


def test_a_uv_lock_gives_its_pinned_packages_with_the_markers_that_need_them(tmp_path: Path) -> None:
    (tmp_path / "uv.lock").write_text(UV_LOCK)
    lines = _requirements(tmp_path, "uv.lock")
    assert lines == (
        "clickutil==1.0",
        "colorama==0.4.6",  # clickutil needs it everywhere, not only where the project's own marker says
        "winonly==2 ; sys_platform == 'win32'",
        "numpy==1.26.4 ; python_version < '3.12'",
        "numpy==2.1.0 ; python_version >= '3.12'",
    ), lines
    # Not the project (editable), its dev group, an extra nobody asked for, nor a package nothing needs.
    with_git = _requirements(tmp_path, "{file: uv.lock, extras: [git]}")
    assert with_git == lines + ("nvml @ git+https://github.com/example/nvml@abc123",), with_git


def test_a_changed_dependency_list_is_another_environment(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    text = "requirements: pyproject.toml\nhosts: [h1]\n"
    first = plan_environment(parse_cluster(text, "c.yaml", tmp_path))
    assert plan_environment(parse_cluster(text, "c.yaml", tmp_path)).plain == first.plain
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.replace("einops>=0.7", "einops>=0.8"))
    assert plan_environment(parse_cluster(text, "c.yaml", tmp_path)).plain != first.plain
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.replace('version = "0.1"', 'version = "0.2"'))
    assert plan_environment(parse_cluster(text, "c.yaml", tmp_path)).plain == first.plain  # only the list counts
    with_gpu = parse_cluster(text.replace("pyproject.toml", "{file: pyproject.toml, extras: [gpu]}"), "c.yaml",
                             tmp_path)
    assert plan_environment(with_gpu).plain != first.plain


@pytest.mark.parametrize("name, content, value, said", [
    ("pyproject.toml", "[project\nname = 1", "pyproject.toml", "pyproject.toml is not valid TOML: "),
    ("pyproject.toml", "[tool.x]\na = 1\n", "pyproject.toml", "pyproject.toml has no [project] table"),
    ("pyproject.toml", "[project]\ndependencies = \"torch\"\n", "pyproject.toml",
     "pyproject.toml: [project].dependencies must be a list of requirement strings"),
    ("pyproject.toml", "[project]\nname = \"x\"\ndynamic = [\"dependencies\"]\n", "pyproject.toml",
     "pyproject.toml: [project].dependencies are dynamic"),
    ("pyproject.toml", PYPROJECT, "{file: pyproject.toml, extras: [cuda]}",
     "pyproject.toml: no optional-dependencies 'cuda' (it has: all, gpu, log)"),
    ("uv.lock", "version = 1\npackage = 3\n", "uv.lock", "uv.lock: [[package]] must be a list of tables"),
    ("uv.lock", "version = 1\n[[package]]\nname = \"a\"\nversion = \"1\"\n", "uv.lock",
     "uv.lock: no package of the lock is the project"),
    ("uv.lock", UV_LOCK.replace('{ name = "clickutil" },', '{ name = "gone" },'), "uv.lock",
     "uv.lock: a dependency on 'gone' that the lock has no package for"),
    ("uv.lock", UV_LOCK, "{file: uv.lock, extras: [cuda]}", "uv.lock: trainer has no extra 'cuda' (it has: git)"),
    ("reqs.txt", "a==1\n", "{file: reqs.txt, extras: [x]}", "requirements.extras: only a pyproject.toml or a uv.lock"),
    ("reqs.txt", "a==1\n", "{file: reqs.txt, extra: [x]}", "requirements.extra: unknown key"),
    ("pyproject.toml", PYPROJECT, "{file: pyproject.toml, extras: gpu}", "requirements.extras: must be a list"),
])
def test_a_malformed_file_is_one_line_naming_it(tmp_path: Path, name: str, content: str, value: str,
                                                said: str) -> None:
    (tmp_path / name).write_text(content)
    message = _error(tmp_path, value)
    assert message.startswith("c.yaml:1: requirements") and said in message and "\n" not in message, message
    if "requirements.extra" not in said:
        assert str(tmp_path / name) in message, message


def test_the_cli_says_a_malformed_pyproject_in_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[project\n")
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: c\nrequirements: pyproject.toml\nhosts: [10.199.0.250]\n")
    done = run_cli("up", str(cluster), timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith(f"error: {cluster}:2: requirements: {tmp_path / 'pyproject.toml'} is not valid TOML")


def test_the_installer_key(tmp_path: Path) -> None:
    assert parse_cluster("installer: pip\nhosts: [h1]\n", "c.yaml", tmp_path).environment.installer == "pip"
    assert parse_cluster("requirements: [a]\nhosts: [h1]\n", "c.yaml", tmp_path).environment.installer == "auto"
    with pytest.raises(ConfigError, match=r"^c.yaml:1: installer: must be one of auto, uv, pip"):
        parse_cluster("installer: conda\nhosts: [h1]\n", "c.yaml", tmp_path)
