"""`distrun checkpoint ls` and `export`: what each checkpoint is, and a model torch reads without distrun."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import run_cli
from tests.integration._recipes import EQUIV

pytestmark = pytest.mark.integration


def test_ls_names_both_formats_in_one_folder_and_export_reads_back_without_distrun(write_recipe, tmp_path):
    """Mirrored writes rank 0's file at step 3; sharded resumes from it and writes its folder at 6."""
    recipe = write_recipe(EQUIV)
    ck = tmp_path / "ck"
    for strategy, steps in (("mirrored", "3"), ("sharded", "6")):
        trained = run_cli("train", str(recipe), "-s", strategy, "--replicas", "2", "--steps", steps, "--resume" if
                          strategy == "sharded" else "--checkpoint-every=3", "--checkpoint-dir", str(ck), "--json")
        assert trained.returncode == 0, trained.stderr[-2000:]
    listed = run_cli("checkpoint", "ls", str(ck), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["step"], r["strategy"], r["world_size"], r["format"]) for r in rows] == [
        (3, "mirrored", 2, "plain"), (6, "sharded", 2, "sharded")]
    assert all(r["bytes"] > 0 and r["parameters"] == 6 * 16 + 16 + 16 * 3 + 3 for r in rows)
    table = run_cli("checkpoint", "ls", str(ck), env={"COLUMNS": "80"})  # a newcomer's terminal: names whole
    assert table.returncode == 0 and "ckpt-000000003.pt" in table.stdout and "ckpt-000000006/" in table.stdout, \
        table.stdout

    out = tmp_path / "model.pt"
    exported = run_cli("checkpoint", "export", str(ck / "ckpt-000000003.pt"), "-o", str(out))
    assert exported.returncode == 0 and exported.stdout.strip() == str(out), exported.stderr
    # A reader with no distrun at all: the import is made to fail, and torch's safe loader reads it.
    code = ("import sys; sys.modules['distrun'] = None\n"
            "import torch, json\n"
            f"sd = torch.load({str(out)!r}, weights_only=True)\n"
            "print(json.dumps({k: list(v.shape) for k, v in sd.items()}))")
    read = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout) == {"0.weight": [16, 6], "0.bias": [16], "2.weight": [3, 16], "2.bias": [3]}
    full = torch.load(ck / "ckpt-000000003.pt", weights_only=True)["model"]
    for key, tensor in torch.load(out, weights_only=True).items():
        assert torch.equal(tensor, full[key])


def test_a_folder_without_checkpoints_is_a_one_line_error(tmp_path):
    result = run_cli("checkpoint", "export", str(tmp_path), "-o", str(tmp_path / "m.pt"))
    assert result.returncode == 5 and "no checkpoint" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    line = result.stderr.strip()
    assert line == f"error: {tmp_path}: no checkpoint (ckpt-<step>.pt or ckpt-<step>/) in this folder", line


def test_a_folder_that_is_not_there_is_exit_5_as_documented(tmp_path):
    for command in (["ls", str(tmp_path / "no" / "such")], ["export", str(tmp_path / "no"), "-o", "m.pt"]):
        result = run_cli("checkpoint", *command)
        assert result.returncode == 5, (command, result.stderr)
        assert result.stderr.strip() == f"error: {command[1]}: no such {'folder' if command[0] == 'ls' else 'file or folder'}"
