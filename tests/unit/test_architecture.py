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
         "CheckpointError", "HostError", "HostUnreachable", "HostKeyError", "Interrupted",
         "train", "Cluster", "JobSummary"]
    )
    for name in distrun.__all__:
        assert hasattr(distrun, name)


def test_every_exit_code_is_documented():
    cli_doc = (REPO / "docs" / "cli.md").read_text()
    for name, code in distrun.errors.EXIT_CODES.items():
        assert f"| {code} | `{name}`" in cli_doc, f"docs/cli.md lacks exit code {code} ({name})"


def _import_cycles(package: str) -> list[list[str]]:
    """Groups of the package's modules that import each other, directly or around a loop
    (TYPE_CHECKING imports count: they are the same design knot), by Tarjan's algorithm."""
    import grimp

    graph = grimp.build_graph(package)
    modules = sorted(module for module in graph.modules if module.split(".")[0] == package)
    edges = {module: sorted(other for other in graph.find_modules_directly_imported_by(module)
                            if other.split(".")[0] == package) for module in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                group.append(other)
                if other == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in modules:
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_around_a_loop() -> None:
    """Issue 34: config/cluster <-> config/_slurm was one; imports flow one way, within packages too."""
    assert _import_cycles("distrun") == []


def test_no_module_is_over_500_lines() -> None:
    """A module past ~500 lines owns more than one thing: split it by what it owns (issue 34)."""
    sizes = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in (REPO / "distrun").rglob("*.py")}
    assert {path: lines for path, lines in sizes.items() if lines > 500} == {}
