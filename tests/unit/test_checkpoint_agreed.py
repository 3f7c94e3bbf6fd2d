"""The ranks agree on rank 0's checkpoint, and a rank whose host lacks a plain one receives it
over the process group (strategies/checkpoint/agreed.py): two real gloo processes, each with its
own folder, as two hosts without shared storage have."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch

from distrun.strategies.checkpoint import files, shards
from tests._sshd import free_port


def _save(folder: Path, step: int, value: float) -> Path:
    return files.save_checkpoint(folder, step, {"model": {"w": torch.full((1000,), value)}, "step": step})


def _rank(rank: int, port: int, cases: list[list[str]], queue) -> None:  # noqa: ANN001 - a spawn target
    """Every case's agreement, one after another in one process group (a spawn costs seconds)."""
    import torch.distributed as dist

    from distrun.strategies.checkpoint import agreed
    from distrun.strategies.checkpoint.catalog import latest_checkpoint

    agreed.CHUNK_BYTES = 1000  # a 4 kB file in several chunks: the chunking is exercised
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for case, folders in enumerate(cases):
            try:
                path, data = agreed.agreed_checkpoint(latest_checkpoint(folders[rank]), torch.device("cpu"))
                got = None if data is None else (float(data["model"]["w"][0]), int(data["step"]))
                queue.put((case, rank, ("ok", str(path) if path else None, got)))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                queue.put((case, rank, (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory):
    """Each case's folders (rank 0's, rank 1's), made up front and agreed on in one spawn; the
    tests read their case's answers by rank."""
    root = tmp_path_factory.mktemp("agreed")
    cases = {name: make(root / name) for name, make in _CASES.items()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    order = list(cases)
    args = [[str(folder) for folder in cases[name][0]] for name in order]
    procs = [ctx.Process(target=_rank, args=(rank, port, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    answers: dict[str, dict[int, tuple]] = {name: {} for name in order}
    for _ in range(2 * len(order)):
        case, rank, answer = queue.get(timeout=120)
        answers[order[case]][rank] = answer
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0, proc.exitcode
    return {name: (cases[name][1], answers[name]) for name in order}


def _newest_on_chief(root: Path) -> tuple[list[Path], Path]:
    chief, other = root / "h1", root / "h2"
    _save(chief, 20, 2.0)
    newest = _save(chief, 30, 3.0)
    _save(other, 10, 1.0)  # an older one of its own: rank 0's newest wins
    return [chief, other], newest


def _same_elsewhere(root: Path) -> tuple[list[Path], Path]:
    chief, other = root / "h1", root / "h2"
    _save(chief, 30, 3.0)
    return [chief, other], _save(other, 30, 3.0)  # the same file, at another path (a shipped copy)


def _stale(root: Path) -> tuple[list[Path], Path]:
    chief, other = root / "h1", root / "h2"
    newest = _save(chief, 30, 3.0)
    other.mkdir(parents=True)
    files.checkpoint_path(other, 30).write_bytes(b"another run's step 30")
    return [chief, other], newest


def _none_on_chief(root: Path) -> tuple[list[Path], None]:
    _save(root / "h2", 10, 1.0)
    return [root / "h1", root / "h2"], None


def _sharded(root: Path) -> tuple[list[Path], Path]:
    chief = root / "h1" / "ckpt-000000030"
    chief.mkdir(parents=True)
    (chief / shards.SIDECAR).write_text("{}")
    return [root / "h1", root / "h2"], chief


_CASES = {"newest": _newest_on_chief, "same": _same_elsewhere, "stale": _stale, "none": _none_on_chief,
          "sharded": _sharded}


def test_a_rank_without_the_chiefs_plain_checkpoint_receives_it(agree) -> None:
    newest, found = agree["newest"]
    assert found[0] == ("ok", str(newest), None), found  # rank 0 reads its own file
    assert found[1] == ("ok", str(newest), (3.0, 30)), found  # rank 1 received step 30's bytes


def test_ranks_that_see_the_same_checkpoint_read_their_own(agree) -> None:
    theirs, found = agree["same"]
    assert found[1] == ("ok", str(theirs), None), found


def test_a_same_named_file_of_another_size_is_not_the_chiefs(agree) -> None:
    newest, found = agree["stale"]
    assert found[1] == ("ok", str(newest), (3.0, 30)), found


def test_no_checkpoint_on_rank_0_is_none_on_every_rank(agree) -> None:
    _, found = agree["none"]
    assert found == {0: ("ok", None, None), 1: ("ok", None, None)}, found


def test_a_sharded_checkpoint_a_rank_lacks_is_one_error_on_every_rank(agree) -> None:
    chief, found = agree["sharded"]
    for rank in (0, 1):
        kind, message = found[rank][:2]
        assert kind == "CheckpointError", found
        assert message.startswith(f"{chief}: a sharded checkpoint rank 0 sees but rank(s) 1 do not"), message


@pytest.mark.parametrize("size", [0, 1])
def test_a_single_process_reads_its_own(tmp_path: Path, size: int) -> None:
    from distrun.strategies.checkpoint.agreed import agreed_checkpoint

    mine = _save(tmp_path, 1, 1.0) if size else None
    assert agreed_checkpoint(mine, torch.device("cpu")) == (mine, None)
