"""Code bundles: deterministic content addresses, what goes in, and unpacking that refuses escapes."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from distrun.client import pack
from distrun.client._job_state import unshipped_hint
from distrun.errors import RecipeError, UsageError
from distrun.server._bundle import BundleError, unpack


@pytest.fixture
def code(tmp_path: Path) -> Path:
    root = tmp_path / "code"
    (root / "pkg").mkdir(parents=True)
    (root / "recipe.py").write_text("import helper\n")
    (root / "helper.py").write_text("X = 1\n")
    (root / "notes.txt").write_text("not python\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "data.csv").write_text("1,2\n")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "helper.cpython-311.pyc").write_bytes(b"\0")
    return root


def test_the_recipe_and_python_files_beside_it(code: Path) -> None:
    bundle = pack(code / "recipe.py")
    assert bundle.files == ("helper.py", "recipe.py") and bundle.recipe == "recipe.py"
    assert bundle.sha256 == hashlib.sha256(bundle.data).hexdigest()


def test_includes_and_ignore_file(code: Path) -> None:
    (code / ".distrunignore").write_text("# data stays home\n*.csv\nhelper.py\n")
    bundle = pack(code / "recipe.py", [code / "pkg", code / "notes.txt"])
    assert bundle.files == ("notes.txt", "pkg/__init__.py", "recipe.py")
    with pytest.raises(UsageError, match="must be inside the recipe's folder"):
        pack(code / "recipe.py", [code.parent])
    with pytest.raises(UsageError, match="no such file or folder"):
        pack(code / "recipe.py", [code / "missing"])


def test_a_recipe_names_the_data_that_travels_with_it(code: Path) -> None:
    """``include = [...]`` in the recipe (issue 34): as --include does, relative to the recipe."""
    (code / "recipe.py").write_text('import helper\ninclude: list[str] = ["notes.txt", "pkg"]\n')
    assert pack(code / "recipe.py").files == ("helper.py", "notes.txt", "pkg/__init__.py", "pkg/data.csv", "recipe.py")
    (code / "recipe.py").write_text('include = ["missing.txt"]\n')
    with pytest.raises(RecipeError, match=r"recipe.py: include 'missing.txt': no such file or folder next to the recipe"):
        pack(code / "recipe.py")


@pytest.mark.parametrize(("line", "message"), [
    ('include = ["../secrets"]', "must be a path inside the recipe's folder"),
    ('include = ["/etc/passwd"]', "must be a path inside the recipe's folder"),
])
def test_a_bad_include_is_named_at_its_line(code: Path, line: str, message: str) -> None:
    (code / "recipe.py").write_text(f"import helper\n{line}\n")
    with pytest.raises(RecipeError, match=rf"recipe.py:2: .*{message}"):
        pack(code / "recipe.py")


@pytest.mark.parametrize("line", ['include = "notes.txt"', "include = sys.argv[1:]", "include = 3"])
def test_an_include_that_is_not_a_list_of_paths_is_the_recipes_own(code: Path, line: str) -> None:
    """A script may have its own ``include``: only a literal list of strings is distrun's."""
    (code / "recipe.py").write_text(f"import sys\n{line}\n")
    assert pack(code / "recipe.py").files == ("helper.py", "recipe.py")


def test_a_missing_bundle_file_that_is_here_says_how_to_ship_it(code: Path) -> None:
    sent = f"FileNotFoundError: [Errno 2] No such file or directory: '/srv/bundles/{'a' * 64}/pkg/data.csv'"
    hint = unshipped_hint(sent, str(code / "recipe.py"))
    assert hint == (f"; pkg/data.csv is next to the recipe here but was not shipped: add include = ['pkg/data.csv'] "
                    f"to recipe.py, or pass --include {code / 'pkg' / 'data.csv'}")
    assert unshipped_hint(sent.replace("data.csv", "other.csv"), str(code / "recipe.py")) == ""  # not here either
    assert unshipped_hint("ValueError: bad", str(code / "recipe.py")) == ""
    relative = "FileNotFoundError: [Errno 2] No such file or directory: 'pkg/data.csv'"  # the rank's folder: the bundle
    assert unshipped_hint(relative, str(code / "recipe.py")).startswith("; pkg/data.csv is next to the recipe here")
    # The traceback's frames name the recipe inside the bundle: never a missing file.
    framed = f'File "/srv/bundles/{"a" * 64}/recipe.py", line 3\nValueError: no'
    assert unshipped_hint(framed, str(code / "recipe.py")) == ""


def test_same_files_same_address_and_an_edit_changes_it(code: Path) -> None:
    first = pack(code / "recipe.py")
    os.utime(code / "helper.py", (1, 1))  # times and owners do not count
    assert pack(code / "recipe.py").sha256 == first.sha256
    (code / "helper.py").write_text("X = 2\n")
    assert pack(code / "recipe.py").sha256 != first.sha256


def test_links_are_never_packed(code: Path) -> None:
    (code / "link.py").symlink_to("/etc/passwd")
    assert "link.py" not in pack(code / "recipe.py").files


def test_a_bundle_unpacks_to_its_files(code: Path, tmp_path: Path) -> None:
    bundle = pack(code / "recipe.py")
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(bundle.data)
    dest = unpack(archive, bundle.sha256, tmp_path / "out" / bundle.sha256)
    assert sorted(p.name for p in dest.iterdir()) == ["helper.py", "recipe.py"]
    assert (dest / "helper.py").read_text() == "X = 1\n"
    assert unpack(archive, bundle.sha256, dest) == dest  # already there: nothing to do


def _evil(tmp_path: Path, add) -> Path:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        ok = tarfile.TarInfo("fine.py")
        ok.size = 1
        tar.addfile(ok, io.BytesIO(b"x"))
        add(tar)
    path = tmp_path / "evil.tar.gz"
    path.write_bytes(raw.getvalue())
    return path


def _file(name: str):
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    return add


def _special(name: str, kind: bytes, target: str = ""):
    def add(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = target
        tar.addfile(info)
    return add


@pytest.mark.parametrize("add, message", [
    (_file("/etc/evil"), "absolute"),
    (_file("../evil.py"), "leaves the bundle"),
    (_file("a/../../evil.py"), "leaves the bundle"),
    (_special("link", tarfile.SYMTYPE, "/etc/passwd"), "is a link"),
    (_special("hard", tarfile.LNKTYPE, "fine.py"), "is a link"),
    (_special("dev", tarfile.CHRTYPE), "device or special file"),
    (_special("fifo", tarfile.FIFOTYPE), "device or special file"),
])
def test_unsafe_members_are_refused_before_anything_is_written(tmp_path: Path, add, message: str) -> None:
    archive = _evil(tmp_path, add)
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    out = tmp_path / "out"
    with pytest.raises(BundleError, match=message):
        unpack(archive, sha, out / sha)
    assert not (out / sha).exists() and list(out.iterdir()) == []  # not even fine.py
    assert not (tmp_path / "evil.py").exists()


def test_a_bundle_must_match_its_name(code: Path, tmp_path: Path) -> None:
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(pack(code / "recipe.py").data)
    with pytest.raises(BundleError, match="sha256 is"):
        unpack(archive, "0" * 64, tmp_path / "out" / ("0" * 64))
