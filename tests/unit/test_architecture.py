"""The shape of the package: import flow, no torch on the control plane, public names."""

import shutil
import subprocess
import sys

import distrun
import distrun.errors
from tests.conftest import REPO


def test_control_plane_imports_without_torch():
    code = ("import sys, distrun.cli, distrun.client, distrun.launch, distrun.links, distrun.scheduler, distrun.server, "
            "distrun.server._main; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_import_contracts_hold():
    lint = shutil.which("lint-imports")
    assert lint, "import-linter is not installed (pip install -e '.[test]')"
    proc = subprocess.run([lint], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_public_api_is_explicit():
    assert sorted(distrun.__all__) == sorted(
        ["__version__", "DistrunError", "UsageError", "ConfigError", "RecipeError", "TrainingError",
         "CheckpointError", "HostError", "HostUnreachable", "HostKeyError", "Interrupted"]
    )
    for name in distrun.__all__:
        assert hasattr(distrun, name)


def test_every_exit_code_is_documented():
    cli_doc = (REPO / "docs" / "cli.md").read_text()
    for name, code in distrun.errors.EXIT_CODES.items():
        assert f"| {code} | `{name}`" in cli_doc, f"docs/cli.md lacks exit code {code} ({name})"
