"""A job in a file, run (issue 34): `--print-config`'s output fed back with `--config` trains the
same job, parameter for parameter, and a flag given beside it wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.integration


def _summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_printed_job_trains_the_same_parameters_and_a_flag_overrides_it(tmp_path: Path) -> None:
    recipe = str(REPO / "recipes" / "linear.py")
    flags = ["-s", "mirrored", "--replicas", "2", "--steps", "6", "--seed", "3", "-b", "16",
             "--checkpoint-dir", str(tmp_path / "flags")]
    by_flags = run_cli("train", recipe, *flags, "--json")
    assert by_flags.returncode == 0, by_flags.stderr[-2000:]
    printed = run_cli("train", recipe, *flags, "--print-config")
    assert printed.returncode == 0 and printed.stdout.startswith("# distrun train RECIPE --config"), printed.stderr
    job = tmp_path / "job.yaml"
    job.write_text(printed.stdout)
    # The same job from the file; the command line's --checkpoint-dir wins over the file's.
    by_file = run_cli("train", recipe, "--config", str(job), "--checkpoint-dir", str(tmp_path / "file"), "--json")
    assert by_file.returncode == 0, by_file.stderr[-2000:]
    one, other = _summary(by_flags.stdout), _summary(by_file.stdout)
    assert (other["strategy"], other["replicas"], other["steps"]) == ("mirrored", 2, 6)
    assert other["final_loss"] == one["final_loss"]
    a = torch.load(latest_checkpoint(tmp_path / "flags"), weights_only=True)
    b = torch.load(latest_checkpoint(tmp_path / "file"), weights_only=True)
    assert a["step"] == b["step"] == 6
    for key, tensor in a["model"].items():
        assert torch.equal(b["model"][key], tensor), key
