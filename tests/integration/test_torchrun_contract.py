"""torchrun's whole contract for plain scripts: its variables, and its per-rank error file."""

from __future__ import annotations

import json

from tests.conftest import assert_no_processes, run_cli

ENV_PROBE = """
import json, os
import torch.distributed as dist
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]
print("ENV " + json.dumps({**{k: os.environ.get(k) for k in keys},
                           "launched": dist.is_torchelastic_launched()}), flush=True)
"""

# Rank 1 runs a child that fails under @record and exits with the child's code: the
# rank's own exception is SystemExit(1), and only the error file knows why.
CHILD_FAILS = """
import subprocess, sys
import torch.distributed as dist

CHILD = '''
from torch.distributed.elastic.multiprocessing.errors import record

@record
def shard():
    raise KeyError("shard 7 is missing")

shard()
'''

dist.init_process_group("gloo")
failed = subprocess.call([sys.executable, "-c", CHILD]) if dist.get_rank() == 1 else 0
sys.exit(failed)
"""


def test_a_plain_script_sees_every_variable_torchrun_sets(write_recipe):
    result = run_cli("train", str(write_recipe(ENV_PROBE)), "-s", "mirrored", "--replicas", "2", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    seen = {}
    for line in result.json_lines():
        if line["type"] == "output" and line["line"].startswith("ENV "):
            seen[line["rank"]] = json.loads(line["line"][4:])
    assert sorted(seen) == [0, 1]
    for rank, env in seen.items():
        assert env["launched"] is True  # torch's own test, which Lightning's TorchElasticEnvironment uses
        assert env["RANK"] == env["ROLE_RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1" and env["ROLE_NAME"] == "default"
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/error-rank{rank}.json")  # in the job's debug folder
    assert seen[0]["TORCHELASTIC_RUN_ID"] == seen[1]["TORCHELASTIC_RUN_ID"].strip() != ""
    assert seen[0]["TORCHELASTIC_ERROR_FILE"] != seen[1]["TORCHELASTIC_ERROR_FILE"]  # one per rank


def test_an_error_file_written_by_record_names_the_failure(write_recipe, tmp_path):
    script = write_recipe(CHILD_FAILS)
    result = run_cli("train", str(script), "-s", "mirrored", "--replicas", "2", "--json")
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]  # TrainingError: rank 1 exited 1
    failed = [line for line in result.json_lines() if line["type"] == "error"]
    assert failed and failed[0]["rank"] == 1, result.stdout[-2000:]
    assert failed[0]["message"] == "KeyError: 'shard 7 is missing'"
    assert (failed[0]["file"], failed[0]["line"]) == ("<string>", 6)  # the child's raise, from its traceback
    assert "shard 7 is missing" in result.stderr and "SystemExit" not in result.stderr
    assert_no_processes(str(tmp_path))


KILLED = """
import os, signal
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finally: what the OOM killer does
dist.barrier()
"""


def test_a_killed_rank_leaves_nothing_in_the_temporary_folder(write_recipe, tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = run_cli("train", str(write_recipe(KILLED)), "-s", "mirrored", "--replicas", "2", "--json",
                     env={"TMPDIR": str(temp)})
    assert result.returncode == 4, result.stderr[-2000:]
    assert "rank 1" in result.stderr and "SIGKILL" in result.stderr
    left = [p.name for p in temp.iterdir() if p.name.startswith("distrun-")]
    assert left == []  # no error-file folder per rank, no debug folder
