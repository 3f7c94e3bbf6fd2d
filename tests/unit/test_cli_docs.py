"""docs/cli.md and the CLI say the same: every flag of `distrun train` is in its table, every
flag the table names exists, and the strategies it lists are the ones `--strategy` takes."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from distrun.cli import app
from distrun.config import StrategyName
from distrun.config.job_file import SECTIONS

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


def test_the_job_file_table_names_every_section_and_key_with_its_flag() -> None:
    """docs/cli.md's --config table is the code's: each section, its panel, each key and its flag."""
    text = CLI_MD.read_text()
    start = text.index("## A job in a file")
    table = text[start:text.index("\n## ", start + 1)]
    command = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    flags = {param.name: max(param.opts, key=len) if param.param_type_name == "option" else "-- ARGS"
             for param in command.params}
    rows = {line.split(" | ")[0][3:-1]: line for line in table.splitlines() if line.startswith("| `")}
    assert list(rows) == [section.name for section in SECTIONS]
    for section in SECTIONS:
        expected = ", ".join(f"`{key}` (`{flags[param]}`)" for key, param in section.keys.items())
        assert rows[section.name] == f"| `{section.name}` | {section.panel} | {expected} |"
    every = {param for section in SECTIONS for param in section.keys.values()}
    not_in_a_file = {"ctx", "recipe", "config", "print_config", "json_output", "debug"}
    assert every | not_in_a_file == set(flags) | {"ctx"}, "a train option is in no section of the job file"
