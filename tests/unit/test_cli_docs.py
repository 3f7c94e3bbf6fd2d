"""docs/cli.md and the CLI say the same: every flag of `distrun train` is in its table, every
flag the table names exists, and the strategies it lists are the ones `--strategy` takes."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from distrun.cli import app
from distrun.config import StrategyName

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
_FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def _section(title_start: str) -> str:
    text = CLI_MD.read_text()
    start = text.index(f"## `{title_start}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _table_flags(section: str) -> set[str]:
    """Flags named in the first column of the section's tables."""
    flags: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `-"):
            first = line.split(" | ")[0]
            flags |= {flag for flag in _FLAG.findall(first) if flag != "--"}
    return flags


def _options(*path: str) -> set[str]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    names: set[str] = set()
    for param in command.params:
        if param.param_type_name == "option":
            names |= set(param.opts) | set(param.secondary_opts)
    return names - {"--help", "-h"}


def test_every_train_flag_is_documented_and_every_documented_flag_exists() -> None:
    documented = _table_flags(_section("distrun train"))
    actual = _options("train")
    assert not actual - documented, f"in the CLI, missing from docs/cli.md: {sorted(actual - documented)}"
    assert not documented - actual, f"in docs/cli.md, not in the CLI: {sorted(documented - actual)}"


def test_the_strategy_row_names_every_strategy() -> None:
    row = next(line for line in _section("distrun train").splitlines() if line.startswith("| `--strategy"))
    missing = [strategy.value for strategy in StrategyName if f"`{strategy.value}`" not in row]
    assert not missing, f"docs/cli.md's --strategy row lacks {missing}"


def test_the_flags_the_cluster_and_job_tables_name_exist() -> None:
    cluster = _section("distrun up")
    for command in ("up", "status", "doctor", "down"):
        row = next(line for line in cluster.splitlines() if line.startswith(f"| `{command}`"))
        named = set(_FLAG.findall(row.split(" | ")[2]))
        assert named <= _options(command), f"{command}: {sorted(named - _options(command))}"
    jobs = _section("distrun jobs")
    for command in ("jobs", "attach", "logs", "cancel", "pull", "stacks"):
        row = next(line for line in jobs.splitlines() if line.startswith(f"| `{command}"))
        named = set(_FLAG.findall(row.split(" | ")[1]))
        assert named <= _options(command), f"{command}: {sorted(named - _options(command))}"
