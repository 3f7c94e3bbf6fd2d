"""A job in a file (issue 34): the sections, their errors (file, line, key, a suggestion), and
the precedence command line > --config > the cluster file's `job:` > the recipe's defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml

from distrun.cli import app
from distrun.config import parse_cluster
from distrun.config.job_file import SECTIONS, parse_job_text
from distrun.errors import ConfigError
from tests.conftest import REPO, run_cli

LINEAR = str(REPO / "recipes" / "linear.py")


def test_the_issues_example_reads_as_written() -> None:
    options = parse_job_text("strategy: {name: mirrored, replicas: 2}\n"
                             "training: {steps: 30, global_batch_size: 32}\n"
                             "checkpoint: {dir: ckpt}\n", "job.yaml")
    assert [(o.param, o.key, o.value, o.where) for o in options] == [
        ("strategy", "strategy.name", "mirrored", "job.yaml:1"), ("replicas", "strategy.replicas", 2, "job.yaml:1"),
        ("steps", "training.steps", 30, "job.yaml:2"), ("global_batch_size", "training.global_batch_size", 32, "job.yaml:2"),
        ("checkpoint_dir", "checkpoint.dir", "ckpt", "job.yaml:3")]


@pytest.mark.parametrize(("text", "message"), [
    ("steps: 3\n", "job.yaml:1: steps: no such section (did you mean training.steps?)"),
    ("trainig: {steps: 3}\n", "job.yaml:1: trainig: no such section (did you mean training?)"),
    ("training:\n  steps: 3\n  checkpoint_dir: x\n", "job.yaml:3: training.checkpoint_dir: no such key (did you mean checkpoint.dir?)"),
    ("checkpoint:\n  kep: 2\n", "job.yaml:2: checkpoint.kep: no such key (did you mean checkpoint.keep?)"),
    ("strategy: {replica: 2}\n", "job.yaml:1: strategy.replica: no such key (did you mean strategy.replicas?)"),
    ("training: 3\n", "job.yaml:1: training: must be a mapping of keys (training: {steps: ...})"),
    ("- strategy\n", "job.yaml:1: must be a mapping of sections"),
    ("training: {steps: 1, steps: 2}\n", "job.yaml:1: training.steps: duplicate key"),
])
def test_a_misspelt_or_misplaced_key_is_named_with_its_line_and_the_nearest(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_job_text(text, "job.yaml")
    assert caught.value.message.startswith(message), caught.value.message


#: The keys whose flag breaks the rule, each with its one parameter: the flag is the section's own
#: word (--strategy, --precision), or reads better so (--keep-checkpoints, not --checkpoint-keep).
FLAG_OUTSIDE_THE_RULE = {
    "strategy.name": "strategy",
    "training.args": "recipe_args",
    "precision.name": "precision",
    "precision.compile": "compile_model",
    "checkpoint.keep": "keep_checkpoints",
    "sharding.within": "shard_within",
}


def test_every_section_key_is_a_flag_without_the_sections_word() -> None:
    """The rule users guess by: `--checkpoint-dir` is checkpoint.dir, `--ps-tasks` is ps.tasks.
    Every key maps to one `distrun train` parameter, by the rule or by its entry above."""
    train_params = {param.name for param in typer.main.get_command(app).commands["train"].params}
    outside = set()
    for section in SECTIONS:
        for key, param in section.keys.items():
            path = f"{section.name}.{key}"
            if path in FLAG_OUTSIDE_THE_RULE:
                outside.add(path)
                assert param == FLAG_OUTSIDE_THE_RULE[path], (path, param)
            else:
                assert param in (key, f"{section.name}_{key}", f"{key}_{section.name}"), (path, param)
            assert param in train_params, (path, param)
    assert outside == set(FLAG_OUTSIDE_THE_RULE), "an entry names a key that no section has"


def test_a_cluster_files_job_section_is_read_with_its_lines(tmp_path: Path) -> None:
    cluster = parse_cluster("hosts:\n  - {address: 10.0.0.1, roles: [chief, worker]}\n"
                            "job:\n  training: {steps: 7}\n  checkpoint:\n    every: 2\n", "lab.yaml")
    assert [(o.key, o.value, o.where) for o in cluster.job] == [("training.steps", 7, "lab.yaml:4"),
                                                                 ("checkpoint.every", 2, "lab.yaml:6")]
    with pytest.raises(ConfigError, match=r"lab.yaml:4: job.training.stepz: no such key"):
        parse_cluster("hosts:\n  - {address: 10.0.0.1, roles: [chief, worker]}\njob:\n  training: {stepz: 7}\n",
                      "lab.yaml")


def _printed(*args: str) -> dict:
    result = run_cli("train", LINEAR, *args, "--print-config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_the_command_line_wins_over_the_file_which_wins_over_the_cluster_and_the_recipe(tmp_path: Path) -> None:
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("hosts:\n  - {address: 10.0.0.1, roles: [chief, worker]}\n"
                       "job:\n  training: {steps: 7, seed: 5, global_batch_size: 8}\n  checkpoint: {every: 3}\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"cluster: {{file: {cluster}}}\ntraining: {{steps: 9, global_batch_size: 16}}\n"
                   "observe: {tracker: mlflow}\n")
    # One key at every level: the recipe's defaults (32), the cluster's job: (8), the file (16), the flag (4).
    assert _printed("--config", str(job), "-b", "4")["training"]["global_batch_size"] == 4
    assert _printed("--cluster", str(cluster))["training"]["global_batch_size"] == 8
    printed = _printed("--config", str(job), "--seed", "11")
    assert printed["training"]["global_batch_size"] == 16
    assert printed["training"]["steps"] == 9  # --config over the cluster's job:
    assert printed["training"]["seed"] == 11  # the command line over both
    assert printed["checkpoint"]["every"] == 3  # the cluster's job: over the recipe's nothing
    assert printed["observe"]["tracker"] == ["mlflow"]  # one value where a flag repeats
    assert printed["strategy"]["name"] == "multi-worker"  # a cluster's default strategy, filled in
    assert _printed("--cluster", str(cluster))["training"]["steps"] == 7
    alone = _printed()  # the recipe's defaults fill what nothing set
    assert alone["training"]["global_batch_size"] == 32 and alone["strategy"]["name"] == "one-device"


@pytest.mark.parametrize(("text", "line"), [
    ("training: {steps: abc}\n", "job.yaml:1: training.steps: expected a whole number, as --steps takes. Received: 'abc'"),
    ("parallel: {tp: 1.5}\n", "job.yaml:1: parallel.tp: expected a whole number, as --tp takes. Received: 1.5"),
    ("checkpoint: {keep: [1, 2]}\n", "job.yaml:1: checkpoint.keep: expected one value (as --keep-checkpoints takes)"),
    ("strategy: {name: mirorred}\n", "job.yaml:1: strategy.name: --strategy: unknown strategy 'mirorred' (did you mean 'mirrored'?)"),
])
def test_a_bad_value_is_one_line_naming_the_file_line_and_key(tmp_path: Path, text: str, line: str) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(text)
    result = run_cli("train", LINEAR, "--config", str(job), "--steps", "1", "--json")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith(f"error: {job.parent}/{line}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert json.loads(result.stdout.strip().splitlines()[-1])["status"] == "failed"  # --json: a failed summary last


def test_train_help_groups_its_options_by_the_files_sections() -> None:
    """`distrun train --help` in panels (issue 34): the job file's sections, in its order, then Output;
    no option is left in the catch-all panel but --help."""
    shown = subprocess.run([sys.executable, "-m", "distrun", "train", "--help"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"}, cwd=REPO, timeout=60).stdout
    panels = [line.strip("╭─╮ ") for line in shown.splitlines() if line.startswith("╭")]
    expected = list(dict.fromkeys(section.panel for section in SECTIONS))
    assert panels == ["Arguments", "Options", *expected, "Output"], panels
    catch_all = shown.split("╭─ Options")[1].split("╰")[0]
    assert "--help" in catch_all and catch_all.count("--") == 1, catch_all


def _commands(group, path=()):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def test_every_command_of_more_than_ten_options_groups_them_in_panels() -> None:
    """Issue 34: other commands get panels where they have more than about 10 options (train,
    bench, node, export slurm); only --help stays in the catch-all panel."""
    import typer.main

    from distrun.cli import app

    crowded = {}
    for name, command in _commands(typer.main.get_command(app)):
        options = [param for param in command.params if param.param_type_name == "option" and param.name != "help"]
        if len(options) > 10:
            crowded[name] = [param.opts[0] for param in options if not getattr(param, "rich_help_panel", None)]
    assert {"train", "bench", "node", "export slurm"} <= set(crowded), sorted(crowded)
    assert {name: left for name, left in crowded.items() if left} == {}


def test_null_means_the_default_and_an_off_form_overrides_a_file(tmp_path: Path) -> None:
    """Review fixes: null is distrun's default (as --print-config writes it), `--no-resume` turns
    off a file's `resume: true`, and an ``a:b`` value stays text (YAML 1.1 would read 2:4 as 124)."""
    job = tmp_path / "job.yaml"
    job.write_text("observe: {log_interval_s: null, profile: 3:4}\ncheckpoint: {keep: null, resume: true}\n"
                   "strategy: {elastic: 2:4}\n")
    printed = _printed("--config", str(job))
    assert printed["observe"]["log_interval_s"] == 0.25 and printed["checkpoint"]["keep"] == 3
    assert printed["observe"]["profile"] == "3:4" and printed["strategy"]["elastic"] == "2:4"
    assert printed["checkpoint"]["resume"] is True
    assert _printed("--config", str(job), "--no-resume")["checkpoint"]["resume"] is False


def test_an_error_about_a_flag_given_here_is_not_pinned_on_the_file(tmp_path: Path) -> None:
    """`--pp-schedule wavy` typed on the command line, `parallel.pp` in the file: the error is the
    flag's own (--pp is a prefix of --pp-schedule, not the same flag)."""
    job = tmp_path / "job.yaml"
    job.write_text("parallel: {pp: 2}\n")
    result = run_cli("train", LINEAR, "-s", "mirrored", "--config", str(job), "--pp-schedule", "wavy")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: --pp-schedule: expected gpipe"), result.stderr
    job.write_text("observe: {tracker: {mlflow: 1}}\n")
    result = run_cli("train", LINEAR, "--config", str(job))
    assert result.returncode == 2 and "observe.tracker: expected a list of values" in result.stderr, result.stderr
