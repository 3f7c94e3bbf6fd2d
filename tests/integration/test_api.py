"""distrun from Python (issue 34): ``distrun.train`` trains what the CLI trains, parameter for
parameter; a Jupyter notebook run by nbclient keeps the live table and the summary in its saved
output; ``distrun.Cluster`` brings this machine's server up and down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

import distrun
from distrun.strategies import latest_checkpoint
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.integration

LINEAR = str(REPO / "recipes" / "linear.py")


def test_importing_distrun_imports_neither_torch_nor_the_cli() -> None:
    code = "import sys, distrun; distrun.__version__; print(sorted(m for m in ('torch', 'typer', 'rich') if m in sys.modules))"
    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert seen.returncode == 0 and seen.stdout.strip() == "[]", seen.stdout + seen.stderr


def test_distrun_train_trains_the_clis_parameters_and_raises_distruns_errors(tmp_path: Path) -> None:
    cli = run_cli("train", LINEAR, "-s", "mirrored", "--replicas", "2", "--steps", "6", "--seed", "3", "-b", "16",
                  "--checkpoint-dir", str(tmp_path / "cli"), "--json")
    assert cli.returncode == 0, cli.stderr[-2000:]
    summary = distrun.train(LINEAR, strategy="mirrored", replicas=2, training={"steps": 6, "seed": 3},
                            global_batch_size=16, checkpoint_dir=tmp_path / "api", progress=False)
    assert isinstance(summary, distrun.JobSummary)
    assert (summary.status, summary.strategy, summary.replicas, summary.steps) == ("succeeded", "mirrored", 2, 6)
    assert summary.final_loss == json.loads(cli.stdout.strip().splitlines()[-1])["final_loss"]
    assert summary.last_checkpoint and Path(summary.last_checkpoint).parent == tmp_path / "api"
    a = torch.load(latest_checkpoint(tmp_path / "cli"), weights_only=True)
    b = torch.load(latest_checkpoint(tmp_path / "api"), weights_only=True)
    for key, tensor in a["model"].items():
        assert torch.equal(b["model"][key], tensor), key
    with pytest.raises(distrun.ConfigError, match="--global-batch-size 33 is not divisible by 2 replicas"):
        distrun.train(LINEAR, strategy="mirrored", replicas=2, steps=1, global_batch_size=33, progress=False)
    with pytest.raises(distrun.UsageError, match=r"no option 'stepz' \(did you mean 'steps'\?\)"):
        distrun.train(LINEAR, stepz=3)
    failing = tmp_path / "fails.py"
    failing.write_text(Path(LINEAR).read_text() + "\n\ndef loss(outputs, batch):\n    raise ValueError('boom')\n")
    with pytest.raises(distrun.TrainingError, match="rank 0 failed at step 1") as caught:  # exit 4 on the command line
        distrun.train(failing, steps=2, progress=False)
    assert caught.value.exit_code == 4 and "ValueError: boom" in str(caught.value)
    # An option given here wins over a file, False too (no command-line token says it); a file's
    # detach never applies (distrun.train waits for the job and returns its summary).
    job = tmp_path / "job.yaml"
    job.write_text(f"checkpoint: {{resume: true, dir: {tmp_path / 'none'}}}\ncluster: {{detach: true}}\n")
    fresh = distrun.train(LINEAR, config=job, resume=False, steps=1, progress=False)
    assert fresh.status == "succeeded" and fresh.resumed is None


def test_a_notebook_keeps_the_live_table_and_the_summary_in_its_saved_output(tmp_path: Path) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import distrun\n"
                                  f"summary = distrun.train({LINEAR!r}, strategy='mirrored', replicas=2, steps=4,\n"
                                  "                        global_batch_size=16)\n"
                                  "print('final loss', summary.final_loss)"),
        nbformat.v4.new_code_cell(f"quiet = distrun.train({LINEAR!r}, steps=2, progress=False)\n"
                                  "print('quiet', quiet.status)"),
    ]
    NotebookClient(notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    path = tmp_path / "run.ipynb"
    nbformat.write(notebook, path)
    saved = nbformat.read(path, as_version=4)
    outputs = saved.cells[0].outputs
    texts = [out.get("data", {}).get("text/plain", "") for out in outputs if out.output_type == "display_data"]
    streams = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert any("step 4/4" in text and "done" in text for text in texts), texts  # the table, as it ended
    assert any("summary" in text and "succeeded" in text and "mirrored × 2" in text for text in texts), texts
    assert "final loss" in streams and not any(out.output_type == "error" for out in outputs), outputs
    quiet = saved.cells[1].outputs
    assert [out.output_type for out in quiet] == ["stream"] and quiet[0].text == "quiet succeeded\n", quiet


def test_a_cluster_comes_up_and_down_from_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTRUN_HOME", str(tmp_path / "home"))
    here = distrun.Cluster()
    try:
        up = here.up()
        assert [row.status.value for row in up.rows] == ["started"]
        assert here.status().rows[0].status.value == "up"
    finally:
        down = here.down()
    assert [row.status.value for row in down.rows] == ["stopped"]
    assert here.status().rows[0].status.value != "up"
