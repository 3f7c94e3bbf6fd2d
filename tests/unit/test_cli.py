"""Command-line surface: help, planned commands, usage errors (no training started)."""

import re

import pytest
import typer
from typer.testing import CliRunner

from distrun.cli import app
from distrun.launch._devices import visible_gpu_count
from tests.conftest import RECIPES, run_cli

MISSION = ("up", "down", "status", "train", "jobs", "attach", "logs", "cancel", "bench")

#: The environment of a run that must see no GPU, on a GPU machine too: distrun counts the GPUs in
#: /proc/driver/nvidia/gpus limited by CUDA_VISIBLE_DEVICES (distrun/launch/_devices.py), and "" leaves none.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def test_no_gpu_hides_every_gpu_from_distruns_count(tmp_path):
    """What the tests below that expect "no GPU found" rest on, checked against 8 GPUs as the driver lists them."""
    for index in range(8):
        (tmp_path / f"0000:{index:02x}:00.0").mkdir()
    assert visible_gpu_count({}, proc_dir=str(tmp_path)) == 8
    assert visible_gpu_count(NO_GPU, proc_dir=str(tmp_path)) == 0


def test_help_lists_every_command_of_the_mission():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in MISSION:
        assert f" {command} " in result.stdout


@pytest.mark.parametrize("args", [("jobs",), ("attach", "J1"), ("logs", "J1"), ("cancel", "J1"), ("pull", "J1"),
                                  ("stacks",)])
def test_job_commands_without_a_server_say_how_to_start_one(args, tmp_path):
    """Local jobs are listed on the local server (issue 36): without one, say how to get that."""
    result = run_cli(*args, env={"DISTRUN_HOME": str(tmp_path)})
    assert result.returncode == 6
    assert result.stderr.strip() == ("error: localhost: no local server: local jobs are listed, followed, stacked "
                                     "and cancelled while `distrun up` (no file) runs here; start it, then the job")


@pytest.mark.parametrize("flag", ["--detach", "--include=x.py"])
def test_cluster_only_train_flags_need_a_cluster(flag):
    result = run_cli("train", str(RECIPES / "linear.py"), flag)
    assert result.returncode == 2 and "needs --cluster" in result.stderr


@pytest.mark.parametrize("command", ["up", "status", "down"])
def test_cluster_commands_name_a_missing_or_invalid_file(command, tmp_path):
    result = run_cli(command, str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and result.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: no such file"
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts:\n  - {address: a}\n  - {address: b, roles: [wroker]}\n")
    result = run_cli(command, str(bad))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {bad}:3: hosts[1].roles[0]: unknown role 'wroker' (did you mean "
                                     "'worker'?); roles are chief, worker, ps, evaluator")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--strategy", "mirored"], "did you mean 'mirrored'"),
        (["-s", "mirrored", "--replicas", "3", "--global-batch-size", "16"], "not divisible by 3 replicas"),
        (["--replicas", "2"], "one-device runs one replica"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--device", "cuda"], "--device cuda: no GPU found"),
        (["--precision", "fp8"], "--precision: expected fp32, bf16, fp16. Received: 'fp8'"),
        (["--compile-mode", "max-autotune"], "--compile-mode max-autotune needs --compile"),
        (["--compile", "--compile-mode", "fastest"], "--compile-mode: expected default, reduce-overhead, max-autotune"),
        (["-s", "ps", "--compile"], "--compile: parameter-server workers pull parameters in forward hooks"),
        (["-s", "ps", "--ps-sync", "--precision", "fp16"], "--precision fp16 with --ps-sync"),
        (["-s", "mirrored", "--compression", "zip"], "--compression: expected none, fp16, bf16 or powersgd[:RANK]. Received: 'zip'"),
        (["-s", "mirrored", "--compression", "powersgd:0"], "the PowerSGD rank must be a whole number of 1 or more"),
        (["-s", "mirrored", "--compression", "fp16:2"], "only powersgd takes a rank"),
        (["--compression", "fp16"], "--strategy one-device has no such exchange"),
        (["-s", "central-storage", "--compression", "bf16"], "--strategy central-storage has no such exchange"),
        (["-s", "mirrored", "--compression", "powersgd", "--powersgd-warmup", "1"], "--powersgd-warmup: expected 2 or more"),
        (["-s", "mirrored", "--powersgd-warmup", "5"], "--powersgd-warmup is for --compression powersgd"),
        (["-s", "multi-worker", "--allreduce", "ring"], "--allreduce: expected flat, hierarchical, auto. Received: 'ring'"),
        (["-s", "central-storage", "--allreduce", "auto"], "--strategy central-storage has no such all-reduce"),
        (["-s", "mirrored", "--allreduce", "hierarchical"], "--strategy mirrored runs on one host"),
        (["-s", "multi-worker", "--allreduce", "hierarchical"], "needs --cluster with two or more worker hosts"),
        (["-s", "multi-worker", "--allreduce", "hierarchical", "--compression", "powersgd"],
         "--allreduce hierarchical with --compression powersgd"),
    ],
)
def test_bad_flags_are_one_line_errors_with_exit_2(args, fragment):
    result = run_cli("train", str(RECIPES / "linear.py"), *args, env=NO_GPU)  # the replica counts are CPU's too
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]


@pytest.mark.parametrize(
    "args, line",
    [
        (["train", "recipes/linear.py", "--bogus"], "error: distrun train: no such option --bogus"),
        (["train", "recipes/linear.py", "--stratgy", "mirrored"],
         "error: distrun train: no such option --stratgy; did you mean --strategy? (`distrun train --help`)"),
        (["train", "recipes/linear.py", "--epoch", "3"],  # click would say "--detach, --epochs, --fetch"
         "error: distrun train: no such option --epoch; did you mean --epochs? (`distrun train --help`)"),
        (["logs"], "error: distrun logs: missing argument 'JOB' (`distrun logs --help`)"),
        (["nosuchcmd"], "error: distrun: no such command 'nosuchcmd' (`distrun --help`)"),
        (["train", "recipes/linear.py", "--steps", "many"], "error: distrun train: invalid value for '--steps'"),
    ],
)
def test_typer_usage_errors_are_one_line_with_exit_2(args, line):
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), result.stderr


@pytest.mark.parametrize("flag", [["--compile"], ["--precision", "bf16"], ["--compression", "fp16"]])
def test_step_flags_are_refused_for_a_plain_script(flag):
    result = run_cli("train", str(RECIPES / "torchrun_script.py"), *flag)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{flag[0]} applies to recipes distrun steps" in lines[0]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["train", "recipes/linear.py", "--cold", "--cluster", "c.yaml"], "--cold is for local jobs"),
        (["bench", "ttfs", "--device", "cuda"], "--device cuda: no GPU found"),
        (["bench", "ttfs", "--device", "tpu"], "--device: expected auto, cpu or cuda. Received: 'tpu'"),
        (["bench", "ttfs", "--repeats", "0"], "--repeats: expected a positive whole number"),
        (["bench", "ttfs", "--replicas", "0"], "--replicas: expected a positive whole number"),
    ],
)
def test_warm_start_and_ttfs_flags_are_one_line_errors(args, fragment, tmp_path):
    if "c.yaml" in args:  # a cluster file that exists: read first, for its job: section
        (tmp_path / "c.yaml").write_text("hosts:\n  - {address: 10.0.0.1, roles: [chief, worker]}\n")
        args = [str(tmp_path / "c.yaml") if arg == "c.yaml" else arg for arg in args]
    result = run_cli(*args, env=NO_GPU)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr


def test_missing_recipe_is_named():
    result = run_cli("train", "no/such/recipe.py")
    assert result.returncode == 2 and result.stderr.strip() == "error: no/such/recipe.py: recipe not found"


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("distrun 0.")


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["-s", "mirrored", "-b", "33"], 2, "--global-batch-size 33 is not divisible by 2 replicas"),
        (["-s", "nosuch"], 2, "unknown strategy 'nosuch'"),
        (["--cluster", "no/such/cluster.yaml"], 2, "no/such/cluster.yaml"),
    ],
)
def test_json_ends_with_a_failed_summary_when_the_job_never_starts(args, code, fragment):
    """live-view.md: the last line of --json is always the summary, on failure too."""
    result = run_cli("train", str(RECIPES / "linear.py"), "--json", *args)
    assert result.returncode == code, result.stderr
    summary = result.summary
    assert summary["status"] == "failed" and fragment in summary["error"] and summary["steps"] == 0
    assert result.stderr.strip().splitlines()[-1] == f"error: {summary['error']}"


def _commands(command, path=()):
    """Every command and subcommand under ``command``, with the words that run it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


#: Rich markup's escape for a bracket, which the rendered help shows as the bracket alone.
_ESCAPED_BRACKET = re.compile(r"\\(\[)")
#: A colour code, where the environment forces colour (FORCE_COLOR) even into a test's capture.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_every_bracketed_text_in_a_help_string_is_shown_by_help(monkeypatch):
    """Rich markup takes `[wandb]` in `pip install 'distrun[wandb]'` for a style tag and drops it:
    every `[...]` in a command's or option's help must come out of `--help` as written."""
    monkeypatch.setenv("COLUMNS", "4000")  # one line per option: a bracket is never wrapped apart
    runner = CliRunner()
    walked = list(_commands(typer.main.get_command(app)))
    assert {("train",), ("checkpoint", "export"), ("export", "slurm")} <= {path for path, _ in walked}
    for path, command in walked:
        helps = [command.help or ""] + [getattr(param, "help", None) or "" for param in command.params]
        meant = [_ESCAPED_BRACKET.sub(r"\1", help_text) for help_text in helps]  # the text as the user should read it
        bracketed = [text for help_text in meant for text in re.findall(r"\[[^\]]*\]", help_text)]
        if not bracketed:
            continue
        result = runner.invoke(app, [*path, "--help"], color=False)
        assert result.exit_code == 0, result.output
        shown = " ".join(_ANSI.sub("", result.output).split())
        missing = [text for text in bracketed if " ".join(text.split()) not in shown]
        assert not missing, f"`distrun {' '.join(path)} --help` drops {missing}"
