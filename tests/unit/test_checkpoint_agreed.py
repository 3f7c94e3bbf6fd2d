"""The ranks agree on one checkpoint, and a rank whose host lacks a plain one receives it over the
process group (strategies/checkpoint/agreed.py): three real gloo processes, each with its own
folder, as three hosts without shared storage have."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch

from distrun.strategies.checkpoint import files, shards
from tests._sshd import free_port

_RANKS = 3


def _save(folder: Path, step: int, value: float) -> Path:
    return files.save_checkpoint(folder, step, {"model": {"w": torch.full((1000,), value)}, "step": step})


def _rank(rank: int, port: int, cases: list[list[str]], queue) -> None:  # noqa: ANN001 - a spawn target
    """Every case's agreement, one after another in one process group (a spawn costs seconds)."""
    import torch.distributed as dist

    from distrun.strategies.checkpoint import agreed
    from distrun.strategies.checkpoint.catalog import latest_checkpoint

    def find(folder: str) -> Path | None:
        if folder.endswith("unlistable"):
            raise PermissionError(13, "Permission denied", folder)
        return latest_checkpoint(folder)

    agreed.CHUNK_BYTES = 1000  # a 4 kB file in several chunks: the chunking is exercised
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=_RANKS)
    try:
        for case, folders in enumerate(cases):
            try:
                path, data = agreed.agreed_checkpoint(lambda: find(folders[rank]), torch.device("cpu"))
                got = None if data is None else (float(data["model"]["w"][0]), int(data["step"]))
                queue.put((case, rank, ("ok", str(path) if path else None, got)))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                queue.put((case, rank, (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory):
    """Each case's folders (one a rank), made up front and agreed on in one spawn; the tests read
    their case's answers by rank."""
    root = tmp_path_factory.mktemp("agreed")
    cases = {name: make(root / name) for name, make in _CASES.items()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    order = list(cases)
    args = [[str(folder) for folder in cases[name][0]] for name in order]
    procs = [ctx.Process(target=_rank, args=(rank, port, args, queue)) for rank in range(_RANKS)]
    for proc in procs:
        proc.start()
    answers: dict[str, dict[int, tuple]] = {name: {} for name in order}
    for _ in range(_RANKS * len(order)):
        case, rank, answer = queue.get(timeout=120)
        answers[order[case]][rank] = answer
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0, proc.exitcode
    return {name: (cases[name][1], answers[name]) for name in order}


def _hosts(root: Path) -> list[Path]:
    return [root / f"h{index}" for index in range(1, _RANKS + 1)]


def _newest_on_chief(root: Path) -> tuple[list[Path], tuple[Path, Path]]:
    h1, h2, h3 = _hosts(root)
    _save(h1, 20, 2.0)
    newest = _save(h1, 30, 3.0)
    _save(h2, 10, 1.0)  # an older one of its own
    return [h1, h2, h3], (newest, _save(h3, 30, 3.0))  # h3: the same file, at its own path


def _another_runs_step(root: Path) -> tuple[list[Path], Path]:
    h1, h2, h3 = _hosts(root)
    newest = _save(h1, 30, 3.0)
    _save(h2, 30, 4.0)  # another run's step 30: the same name and size, other weights
    h3.mkdir(parents=True)
    files.checkpoint_path(h3, 30).write_bytes(b"another run's step 30")
    assert newest.stat().st_size == files.checkpoint_path(h2, 30).stat().st_size
    return [h1, h2, h3], newest


def _newer_elsewhere(root: Path) -> tuple[list[Path], Path]:
    h1, h2, h3 = _hosts(root)
    _save(h1, 20, 2.0)  # the launch's rank 0 holds an older one: an elastic job's chief moved
    return [h1, h2, h3], _save(h2, 30, 3.0)


def _nowhere(root: Path) -> tuple[list[Path], None]:
    return _hosts(root), None


def _sharded(root: Path) -> tuple[list[Path], Path]:
    h1, h2, h3 = _hosts(root)
    chief = h1 / "ckpt-000000030"
    chief.mkdir(parents=True)
    (chief / shards.SIDECAR).write_text("{}")
    return [h1, h2, h3], chief


def _unlistable(root: Path) -> tuple[list[Path], Path]:
    h1, _, h3 = _hosts(root)
    return [h1, root / "unlistable", h3], _save(h1, 30, 3.0)


_CASES = {"newest": _newest_on_chief, "another": _another_runs_step, "newer": _newer_elsewhere, "nowhere": _nowhere,
          "sharded": _sharded, "unlistable": _unlistable}


def test_a_rank_without_the_newest_plain_checkpoint_receives_it_and_one_with_a_copy_reads_its_own(agree) -> None:
    (newest, copy), found = agree["newest"]
    assert found[0] == ("ok", str(newest), None), found  # rank 0 reads its own file
    assert found[1] == ("ok", str(newest), (3.0, 30)), found  # rank 1 received step 30's bytes
    assert found[2] == ("ok", str(copy), None), found  # rank 2 holds the same file: outside the sending group


def test_another_runs_same_named_file_is_not_the_checkpoint_even_at_the_same_size(agree) -> None:
    newest, found = agree["another"]
    assert found[1] == found[2] == ("ok", str(newest), (3.0, 30)), found


def test_the_newest_step_on_any_host_is_the_one_sent_from_there(agree) -> None:
    newest, found = agree["newer"]
    assert found[1] == ("ok", str(newest), None), found
    assert found[0] == found[2] == ("ok", str(newest), (3.0, 30)), found


def test_no_checkpoint_anywhere_is_none_on_every_rank(agree) -> None:
    _, found = agree["nowhere"]
    assert found == {rank: ("ok", None, None) for rank in range(_RANKS)}, found


def test_a_sharded_checkpoint_a_rank_lacks_is_one_error_on_every_rank(agree) -> None:
    chief, found = agree["sharded"]
    for rank in range(_RANKS):
        kind, message = found[rank][:2]
        assert kind == "CheckpointError", found
        assert message.startswith(f"{chief}: a sharded checkpoint rank 0 holds but rank(s) 1, 2 do not see"), message


def test_a_folder_a_rank_cannot_list_is_an_error_on_every_rank_not_a_wait(agree) -> None:
    newest, found = agree["unlistable"]
    assert found[1][:2] == ("CheckpointError", f"{newest.parent.parent}/unlistable: cannot look for a checkpoint: "
                                               "Permission denied"), found
    for rank in (0, 2):
        assert found[rank][:2] == ("CheckpointError", "rank(s) 1 could not look for the checkpoint (their own errors "
                                                      "say why)"), found


@pytest.mark.parametrize("size", [0, 1])
def test_a_single_process_reads_its_own(tmp_path: Path, size: int) -> None:
    from distrun.strategies.checkpoint.agreed import agreed_checkpoint

    mine = _save(tmp_path, 1, 1.0) if size else None
    assert agreed_checkpoint(lambda: mine, torch.device("cpu")) == (mine, None)
