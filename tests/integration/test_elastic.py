"""``--elastic`` on one machine: real processes, a real store process, real gloo groups.

A replica is SIGKILLed (or hangs) mid-run. The others must go on from the state they
hold, lose no committed step, and end with one-device's parameters; the lost rank is
started again and rejoins, healed by a peer.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import assert_no_processes, run_cli
from tests.integration._recipes import DIST_ERROR_EVERY_STEP, ELASTIC, RAISES_IN_RANK_1

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]


STEPS = 60


def _train(recipe, *args):
    return run_cli("train", str(recipe), "--json", "--device", "cpu", *args)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The reference: the same recipe, global batches and steps on one device."""
    folder = tmp_path_factory.mktemp("one-device")
    recipe = folder / "elastic.py"
    recipe.write_text(ELASTIC)
    result = _train(recipe, "--strategy", "one-device", "--steps", str(STEPS), "--checkpoint-dir", str(folder / "ck"))
    assert result.returncode == 0, result.stderr[-2000:]
    return torch.load(latest_checkpoint(folder / "ck"), weights_only=True)["model"]


def _lose_rank_2_at_step_10(tmp_path, *faults: str):
    """A 3-replica ``--elastic 1:3`` job whose rank 2 dies in step 10 (its first start), with the
    recipe's ``faults`` besides; it must succeed."""
    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "3", "--elastic", "1:3", "--steps", str(STEPS),
                    "--checkpoint-dir", str(tmp_path / "ck"), "--", "--die-rank", "2", "--die-at", "10",
                    "--once", str(tmp_path / "once"), "--sleep-s", "0.2", *faults)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _no_step_lost_and_one_devices_parameters(result, tmp_path, one_device) -> None:
    """The job trained every step once, with no restart, and its last checkpoint holds
    one-device's parameters; none of its processes is left."""
    summary = result.summary
    assert summary["steps"] == STEPS and summary["restarts"] == 0 and summary["steps_lost"] == 0, summary
    model = torch.load(latest_checkpoint(tmp_path / "ck"), weights_only=True)["model"]
    for key, tensor in one_device.items():
        torch.testing.assert_close(model[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    assert_no_processes(str(tmp_path))


def test_a_lost_replica_costs_no_step_and_rejoins(tmp_path, one_device):
    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "3", "--elastic", "2:3", "--steps", str(STEPS),
                    "--checkpoint-dir", str(tmp_path / "ck"), "--",
                    # Slow enough steps that the restarted rank (a cold interpreter: ~2 s, ~4 s on a
                    # busy 2-core machine) arrives before the job's last step.
                    "--die-rank", "2", "--die-at", "10", "--once", str(tmp_path / "once"), "--sleep-s", "0.2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.json_lines()
    changes = [line for line in lines if line["type"] == "membership"]
    assert [c["world_size"] for c in changes] == [2, 3], changes
    assert changes[0]["left"] == ["rank 2 on 127.0.0.1 (killed by SIGKILL)"]  # who, and why
    assert changes[0]["step"] == 9  # rank 2 died in step 10
    assert changes[1]["joined"] == ["rank 2 on 127.0.0.1"] and changes[1]["step"] > 9
    assert [line["returncode"] for line in lines if line["type"] == "exited" and line["rank"] == 2][0] == -9
    assert sum(1 for line in lines if line["type"] == "started" and line["rank"] == 2) == 2  # it came back
    summary = result.summary
    assert summary["steps"] == STEPS and summary["restarts"] == 0
    assert summary["membership_changes"] == 2 and summary["steps_lost"] == 0 and summary["world_size"] == 3
    assert 0 < summary["recovery_s"] < 10
    # No checkpoint was read, and the parameters are one-device's: every global batch was
    # trained once, the one of the failed step split over two, and the rejoined rank healed.
    model = torch.load(latest_checkpoint(tmp_path / "ck"), weights_only=True)["model"]
    for key, tensor in one_device.items():
        torch.testing.assert_close(model[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    assert_no_processes(str(tmp_path))


def test_a_replica_lost_inside_a_recovery_is_one_more_change(tmp_path, one_device):
    """Rank 2 dies at step 10; when it rejoins, rank 1 dies inside the heal that brings it in.
    The members still there recover again (the joiner too, holding nothing yet), and the job
    ends with one-device's parameters: a heal that fails writes no member's state."""
    result = _lose_rank_2_at_step_10(tmp_path, "--die-in-heal", "1")
    lines = result.json_lines()
    assert [line["returncode"] for line in lines if line["type"] == "exited" and line["rank"] == 1][0] == -9
    notes = [line["line"] for line in lines if line["type"] == "output" and "rank 1 lost" in line["line"]]
    assert notes, "rank 1 never died in a heal"
    changes = [line for line in lines if line["type"] == "membership"]
    # The change the retry finished is told from the group that last trained: rank 1 left and
    # rank 2 joined in one event (not the failed round's view, where neither would show).
    assert any(any(who.startswith("rank 1 on 127.0.0.1") for who in c["left"]) and c["joined"] == ["rank 2 on 127.0.0.1"]
               for c in changes), changes
    _no_step_lost_and_one_devices_parameters(result, tmp_path, one_device)


def test_members_lost_as_a_group_forms_and_before_a_heal_is_described(tmp_path, one_device):
    """Rank 2 dies at step 10. Its next start dies as its first group forms: the others, in
    ``init_process_group`` waiting for its address, stop once it is marked lost (before: the
    store's 300 s timeout). Its third start joins; rank 0, the heal's source, dies before it
    writes the manifest the others wait for: they stop waiting once the record says the round
    is over (before: ``store.get`` for 300 s). The job goes on each time, losing no step."""
    result = _lose_rank_2_at_step_10(tmp_path, "--die-joining", "2", "--die-describing", "0")
    lines = result.json_lines()
    exits = {rank: [line["returncode"] for line in lines if line["type"] == "exited" and line["rank"] == rank]
             for rank in (0, 2)}
    assert exits == {0: [-9, 0], 2: [-9, -9, 0]}, exits
    changes = [line for line in lines if line["type"] == "membership"]
    # The joiner lost as its group formed is named as having left (it never trained).
    assert (changes[1]["left"], changes[1]["joined"], changes[1]["world_size"]) == (
        ["rank 2 on 127.0.0.1 (killed by SIGKILL)"], [], 2), changes
    assert changes[1]["recovery_s"] < 30, changes  # not the store's timeout
    lost_source = [c for c in changes if any(who.startswith("rank 0 on 127.0.0.1") for who in c["left"])]
    assert lost_source and lost_source[0]["joined"] == ["rank 2 on 127.0.0.1"], changes
    assert lost_source[0]["recovery_s"] < 30, lost_source
    _no_step_lost_and_one_devices_parameters(result, tmp_path, one_device)


def test_a_joiner_whose_first_group_fails_to_form_joins_the_next(tmp_path, one_device):
    """Rank 2 dies at step 10; as the group that takes its next start in forms, rank 1 dies.
    The joiner's first group never forms: it goes on to the next round with rank 0 (before: it
    failed the job, "rank 2 failed while preparing the model ... DistNetworkError"), is healed
    there, and rank 1 comes back later."""
    result = _lose_rank_2_at_step_10(tmp_path, "--die-forming", "1")
    lines = result.json_lines()
    assert [line["returncode"] for line in lines if line["type"] == "exited" and line["rank"] == 1] == [-9, 0]
    changes = [line for line in lines if line["type"] == "membership"]
    assert (changes[1]["left"], changes[1]["joined"]) == (["rank 1 on 127.0.0.1 (killed by SIGKILL)"],
                                                          ["rank 2 on 127.0.0.1"]), changes
    assert changes[1]["recovery_s"] < 30, changes
    _no_step_lost_and_one_devices_parameters(result, tmp_path, one_device)


def test_a_hung_replica_is_treated_as_lost(tmp_path, one_device):
    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "2", "--elastic", "1:2", "--steps", str(STEPS),
                    "--hang-timeout-s", "3", "--checkpoint-dir", str(tmp_path / "ck"), "--",
                    "--hang-rank", "1", "--die-at", "10", "--once", str(tmp_path / "once"), "--sleep-s", "0.02")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.json_lines()
    hung = [line for line in lines if line["type"] == "hang"]
    assert hung and hung[0]["rank"] == 1
    notes = [line["line"] for line in lines if line["type"] == "output" and "lost (hung" in line["line"]]
    assert notes and notes[0].startswith("[distrun] rank 1 lost (hung for"), notes
    left = next(line for line in lines if line["type"] == "membership")["left"]
    assert left[0].startswith("rank 1 on 127.0.0.1 (hung for"), left  # the event says why, too
    for diagnosis in (line for line in lines if line["type"] == "diagnosis" and line.get("dump_dir")):
        shutil.rmtree(diagnosis["dump_dir"])  # the hang's dumps stay for a user to read; a test reads them here
    assert result.summary["steps"] == STEPS and result.summary["steps_lost"] == 0
    assert result.summary["membership_changes"] >= 1
    model = torch.load(latest_checkpoint(tmp_path / "ck"), weights_only=True)["model"]
    for key, tensor in one_device.items():
        torch.testing.assert_close(model[key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    assert_no_processes(str(tmp_path))


def test_below_the_minimum_the_job_stops_and_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTRUN_HOME")  # cold, as without `distrun up`: the rest of the module starts warm
    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "2", "--elastic", "2", "--steps", str(STEPS),
                    "--", "--die-rank", "1", "--die-at", "5", "--once", str(tmp_path / "once"))
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]  # a training error
    assert "1 replica(s) left, fewer than --elastic MIN 2" in result.stderr, result.stderr[-2000:]
    assert "restart from the newest checkpoint" in result.stderr
    assert result.stderr.count("Traceback") == 0
    assert_no_processes(str(tmp_path))


def test_a_recipe_error_still_fails_an_elastic_job(write_recipe, tmp_path):
    """Only a rank that vanishes is a change of membership; an exception is the recipe's."""
    result = _train(write_recipe(RAISES_IN_RANK_1), "--strategy", "mirrored", "--replicas", "2",
                    "--elastic", "1:2", "--steps", "20")
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]  # TrainingError: a replica raised
    assert "boom at step 3" in result.stderr
    assert not [line for line in result.json_lines() if line["type"] == "membership"]
    assert_no_processes(str(tmp_path))


def test_a_recipe_error_that_reads_like_a_lost_peer_still_fails_the_job(write_recipe, tmp_path):
    """The decision comes from the membership record, never from an exception's text: a
    RuntimeError saying "Connection refused" while every peer is alive is the recipe's."""
    recipe = RAISES_IN_RANK_1.replace('raise ValueError("boom at step 3")',
                                      'raise RuntimeError("Connection refused by the feature store at step 3")')
    result = _train(write_recipe(recipe), "--strategy", "mirrored", "--replicas", "2", "--elastic", "1:2",
                    "--steps", "20")
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]  # TrainingError: a replica raised
    assert "Connection refused by the feature store at step 3" in result.stderr
    assert ".py:" in result.stderr.splitlines()[-1], result.stderr[-500:]  # it names the recipe's line
    assert not [line for line in result.json_lines() if line["type"] == "membership"]
    assert_no_processes(str(tmp_path))



def test_a_backend_error_with_every_peer_alive_fails_the_job_in_one_line(write_recipe, tmp_path):
    """A ``DistError`` is a change of membership only where the record says the round is over: with
    every peer alive it is the recipe's, and the job ends at once. Before, each one was taken for a
    change of membership: recovered from, raised again, forever (as a gloo size mismatch did); with
    only the cap of recoveries without progress, this job ends on ``NoProgress`` instead (checked)."""
    result = _train(write_recipe(DIST_ERROR_EVERY_STEP), "--strategy", "mirrored", "--replicas", "2",
                    "--elastic", "1:2", "--steps", "20")
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert "simulated size mismatch at step 3" in result.stderr.splitlines()[-1], result.stderr[-1500:]
    assert "Traceback" not in result.stderr and "NoProgress" not in result.stderr, result.stderr[-1500:]
    assert not [line for line in result.json_lines() if line["type"] == "membership"]
    assert_no_processes(str(tmp_path))


def test_a_replica_cut_off_from_the_store_leaves_and_rejoins_as_a_joiner(tmp_path, one_device):
    """Rank 2's store connections break at step 10 (what a partition longer than TCP waits leaves:
    torch's store client never reconnects). It is cut off: it leaves with its own exit code, no
    failure, and its launcher starts it again as a joiner, healed by a peer (issue 52: it failed the
    job with "Broken pipe")."""
    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "3", "--elastic", "1:3", "--steps", str(STEPS),
                    "--checkpoint-dir", str(tmp_path / "ck"), "--", "--cut-store", "2", "--cut-store-at", "10",
                    "--sleep-s", "0.2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    notes = [line["line"] for line in result.json_lines() if line["type"] == "output"]
    assert any(note.startswith("[distrun] rank 2 cut off from the job: its connection to the store broke")
               for note in notes), notes[-10:]
    assert any("rank 2 lost (cut off from the job's store" in note and "starting it again" in note
               for note in notes), notes[-10:]
    assert [c["world_size"] for c in result.json_lines() if c["type"] == "membership"] == [2, 3]
    assert "frame #" not in result.stderr, result.stderr[-2000:]
    _no_step_lost_and_one_devices_parameters(result, tmp_path, one_device)


SCHEDULED = ELASTIC + """

def scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.2 * step))


from distrun.callbacks import Callback


class _Seen(Callback):
    \"\"\"Counts the steps it saw; its count is its state, so a joiner healed from a peer goes on from it.\"\"\"

    def __init__(self):
        self.seen = 0

    def on_step_end(self, state):
        self.seen += 1

    def on_train_end(self, state):
        print(f"[seen] {self.seen} steps", flush=True)

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = int(state["seen"])


def callbacks():
    return [_Seen()]
"""


def test_a_lost_replica_rejoins_with_the_learning_rate_schedule_where_it_was(tmp_path):
    """The schedule's state travels with a heal: rank 2, killed at step 10 and healed as a joiner,
    and the survivors all step the source's schedule, so the job ends with the parameters of
    one device on the same schedule (an lr that changes every step: one step off fails it). So
    does the callbacks' state (their checkpoints' ``extra``)."""
    recipe = tmp_path / "scheduled.py"
    recipe.write_text(SCHEDULED)
    alone = _train(recipe, "--strategy", "one-device", "--steps", str(STEPS), "--checkpoint-dir", str(tmp_path / "one"))
    assert alone.returncode == 0, alone.stderr[-2000:]
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "3", "--elastic", "1:3", "--steps", str(STEPS),
                    "--checkpoint-dir", str(tmp_path / "ck"), "--", "--die-rank", "2", "--die-at", "10",
                    "--once", str(tmp_path / "once"), "--sleep-s", "0.2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [c["world_size"] for c in result.json_lines() if c["type"] == "membership"] == [2, 3]
    reference = torch.load(latest_checkpoint(tmp_path / "one"), weights_only=True)
    _no_step_lost_and_one_devices_parameters(result, tmp_path, reference["model"])
    healed = torch.load(latest_checkpoint(tmp_path / "ck"), weights_only=True)
    assert healed["lr_scheduler"]["last_epoch"] == reference["lr_scheduler"]["last_epoch"] == STEPS
    # The callbacks' state travels too: the joiner's count went on from its source's, so every rank
    # that ended the job saw every step (a joiner without it would count from its join).
    seen = {line["rank"]: line["line"] for line in result.json_lines()
            if line["type"] == "output" and line["line"].startswith("[seen]")}
    assert sorted(seen) == [0, 1, 2] and set(seen.values()) == {f"[seen] {STEPS} steps"}, seen

def test_a_lost_replica_with_compressed_gradients(tmp_path):
    """With a comm hook (bf16 on the wire), DDP is rebuilt for the new group and the hook attached anew."""
    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "3", "--elastic", "2:3", "--compression", "bf16",
                    "--steps", str(STEPS), "--", "--die-rank", "2", "--die-at", "10", "--once", str(tmp_path / "once"),
                    "--sleep-s", "0.2")  # the restarted rank arrives before the last step (see above)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [c["world_size"] for c in result.json_lines() if c["type"] == "membership"] == [2, 3]
    assert result.summary["steps"] == STEPS and result.summary["steps_lost"] == 0
    assert_no_processes(str(tmp_path))


def test_a_rank_lost_in_its_second_micro_batch_redoes_the_whole_global_step(tmp_path, one_device):
    """--accumulate 2: rank 2 dies in step 10's second micro-batch (its 20th loss), after the first
    left gradients behind. The survivors redo step 10 whole, on 9 rows a replica (5 + 4): the job
    ends with one-device's parameters, no step lost."""
    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = _train(recipe, "--strategy", "mirrored", "--replicas", "3", "--elastic", "1:3", "--steps", str(STEPS),
                    "--accumulate", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--", "--die-rank", "2",
                    "--die-at", "20", "--once", str(tmp_path / "once"), "--sleep-s", "0.1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    changes = [line for line in result.json_lines() if line["type"] == "membership"]
    assert changes and changes[0]["step"] == 9 and changes[0]["world_size"] == 2, changes
    _no_step_lost_and_one_devices_parameters(result, tmp_path, one_device)
