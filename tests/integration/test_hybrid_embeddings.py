"""`--embeddings ps` (the hybrid): mirrored replicas with DDP for the dense layers, the large
embedding tables on local ps tasks split by rows, one synchronous update per step.

Real local jobs through the CLI: two replicas in one gloo group, ps tasks reached through
their own gloo pairs, compared with one-device training of the same recipe.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from distrun.strategies import latest_checkpoint
from distrun.strategies.data.plan import GlobalBatchPlan
from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

RECOMMENDER = str(REPO / "recipes" / "recommender.py")
HYBRID = ("--strategy", "mirrored", "--replicas", "2", "--embeddings", "ps")
USERS_ROWS, USER_DIM = 20_000, 16


def _train(*args: str) -> list[dict]:
    cut = args.index("--") if "--" in args else len(args)
    result = run_cli("train", *args[:cut], "--json", *args[cut:])
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _checkpoint(folder: Path) -> dict:
    return torch.load(latest_checkpoint(folder), weights_only=True)


def _assert_same_training(hybrid: dict, one: dict) -> None:
    """The parameters, and the optimizer's state, of one-device's run (float tolerance)."""
    assert hybrid["step"] == one["step"] == 20
    assert list(hybrid["model"]) == list(one["model"])  # every table back in the plain model, in its order
    for key, tensor in one["model"].items():
        torch.testing.assert_close(hybrid["model"][key], tensor, rtol=0, atol=1e-6, msg=key)
    assert hybrid["optimizer"]["param_groups"] == one["optimizer"]["param_groups"]
    assert sorted(hybrid["optimizer"]["state"]) == sorted(one["optimizer"]["state"])
    for index, state in one["optimizer"]["state"].items():  # Adagrad's sums, the tables' from the ps tasks
        for key, value in state.items():
            torch.testing.assert_close(hybrid["optimizer"]["state"][index][key], value, rtol=0, atol=1e-6,
                                       msg=f"{index}.{key}")


def _recipe() -> Any:
    spec = importlib.util.spec_from_file_location("recommender_under_test", RECOMMENDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipe_model() -> torch.nn.Module:
    return _recipe().model()


def _expected_bytes_per_step(tables: dict[str, slice], steps: int = 20) -> dict[int, float]:
    """Each replica's mean bytes a step of table rows, from the batches it read: per table, the
    batch's unique ids times a row's bytes (fp32), once pulled and once pushed as a gradient.
    ``tables``: the recipe's table name -> the columns of a sample that index it."""
    recipe = _recipe()
    ids = recipe.train_data(None).tensors[0]
    row_bytes = {"users": recipe.USER_DIM * 4, "categories": recipe.CATEGORY_DIM * 4}
    plan = GlobalBatchPlan(len(ids), recipe.defaults["global_batch_size"], 2, seed=0)  # the job's default seed
    order = plan.order(0)
    expected = {}
    for replica in range(2):
        total = 0
        for batch in range(steps):
            mine = ids[list(plan.share(order, batch, replica).indices)]
            total += sum(2 * torch.unique(mine[:, columns]).numel() * row_bytes[name]
                         for name, columns in tables.items())
        expected[replica] = total / steps
    return expected


def _dense_grad_bytes(off_ps: tuple[str, ...]) -> int:
    """The recipe model's parameters but the tables on the ps tasks, in fp32 bytes: what DDP all-reduces."""
    return sum(p.numel() * 4 for name, p in _recipe_model().named_parameters() if name.split(".")[0] not in off_ps)


def _assert_bytes_moved(lines: list[dict], embeddings: dict[int, float], dense: int) -> None:
    """Each replica's last Step event, the live line and the summary report what the batches moved."""
    last = {line["rank"]: line for line in lines if line.get("type") == "step"}
    for replica, figure in embeddings.items():
        assert last[replica]["embedding_bytes_per_step"] == pytest.approx(figure, rel=1e-9), (replica, figure)
        assert last[replica]["dense_grad_bytes_per_step"] == dense
    summary = lines[-1]
    assert summary["embedding_bytes_per_step"] == pytest.approx(sum(embeddings.values()) / 2, rel=1e-9)
    assert summary["dense_grad_bytes_per_step"] == dense


def test_adagrad_with_the_table_on_one_ps_task_ends_with_one_device_parameters(tmp_path: Path) -> None:
    lines = _train(RECOMMENDER, *HYBRID, "--ps-tasks", "1", "--ps-partition-mb", "1", "--steps", "20",
                   "--checkpoint-dir", str(tmp_path / "hybrid"))
    placement = [line["line"] for line in lines if line.get("type") == "output" and "[placement]" in line["line"]]
    assert any("ps0:" in p and f"users.weight[0:{USERS_ROWS}]" in p for p in placement), placement
    assert any("DDP on every replica" in p for p in placement), placement  # the small table stays with DDP
    ps = [line for line in lines if line.get("type") == "ps"]
    assert ps[-1]["params"] == USERS_ROWS * USER_DIM and ps[-1]["updates"] == 20  # one update a step, not two
    # Only the rows a batch looks up travel: over 20 steps, less than the table once (mirrored all-reduces
    # it whole every step). Each replica says so in a log, beside its dense gradients' bytes.
    moved = [line["scalars"] for line in lines if line.get("type") == "log" and "embedding_mb" in line["scalars"]]
    assert moved and 0 < moved[0]["embedding_mb"] * 2**20 < USERS_ROWS * USER_DIM * 4, moved
    assert moved[0]["dense_grad_mb"] > 0
    summary = lines[-1]
    assert summary["status"] == "succeeded" and summary["replicas"] == 2 and summary["steps"] == 20
    _assert_bytes_moved(lines, _expected_bytes_per_step({"users": slice(0, 1)}), _dense_grad_bytes(("users",)))
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", "--checkpoint-dir", str(tmp_path / "one"))
    hybrid, one = _checkpoint(tmp_path / "hybrid"), _checkpoint(tmp_path / "one")
    _assert_same_training(hybrid, one)
    plain = _recipe_model()
    plain.load_state_dict(hybrid["model"])  # strict: the recipe's own model, tables included
    assert torch.equal(plain.users.weight, hybrid["model"]["users.weight"])


def test_both_tables_split_over_two_ps_tasks_equal_one_device(tmp_path: Path) -> None:
    """A partition small enough that the EmbeddingBag goes too: every table split by rows."""
    lines = _train(RECOMMENDER, *HYBRID, "--ps-tasks", "2", "--ps-partition-mb", "0.001", "--steps", "20",
                   "--checkpoint-dir", str(tmp_path / "hybrid"))
    placement = [line["line"] for line in lines if line.get("type") == "output" and "[placement]" in line["line"]]
    assert any("ps0:" in p and "users.weight[0:10000]" in p and "categories.weight[0:32]" in p
               for p in placement), placement
    assert any("ps1:" in p and "users.weight[10000:20000]" in p for p in placement), placement
    # The category table's ids repeat within a batch (3 a sample of 64): each row crosses once a step.
    _assert_bytes_moved(lines, _expected_bytes_per_step({"users": slice(0, 1), "categories": slice(1, None)}),
                        _dense_grad_bytes(("users", "categories")))
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", "--checkpoint-dir", str(tmp_path / "one"))
    _assert_same_training(_checkpoint(tmp_path / "hybrid"), _checkpoint(tmp_path / "one"))


def test_compile_compiles_the_dense_part_and_still_equals_one_device(tmp_path: Path) -> None:
    lines = _train(RECOMMENDER, *HYBRID, "--ps-tasks", "1", "--ps-partition-mb", "1", "--steps", "20", "--compile",
                   "--checkpoint-dir", str(tmp_path / "hybrid"))
    compiled = [line for line in lines if line.get("type") == "compile"]
    assert compiled and compiled[-1]["graphs"] >= 1, compiled  # the MLP ran compiled; each table's forward is a break
    assert any("RemoteEmbedding" in reason for reason in compiled[-1]["reasons"]), compiled[-1]["reasons"]
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", "--checkpoint-dir", str(tmp_path / "one"))
    _assert_same_training(_checkpoint(tmp_path / "hybrid"), _checkpoint(tmp_path / "one"))


def test_fp16_unscales_the_rows_too_and_ends_within_rounding_of_one_device(tmp_path: Path) -> None:
    """Tolerance as tests/integration/test_precision.py reasons it: each replica rounds its own half
    batch; Adagrad moves a weight by at most about lr a step, so the layouts drift apart by at most
    steps x lr x fp16's roundoff. fp16 itself must matter more, or autocast did nothing. Were the
    rows' gradients left scaled (65536x), the table would be far off."""
    _train(RECOMMENDER, *HYBRID, "--ps-tasks", "1", "--ps-partition-mb", "1", "--steps", "20", "--precision", "fp16",
           "--checkpoint-dir", str(tmp_path / "hybrid"))
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", "--precision", "fp16",
           "--checkpoint-dir", str(tmp_path / "one"))
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", "--checkpoint-dir", str(tmp_path / "fp32"))
    hybrid, one, fp32 = (_checkpoint(tmp_path / name) for name in ("hybrid", "one", "fp32"))

    def max_diff(a: dict, b: dict) -> float:
        return max((a["model"][key] - value).abs().max().item() for key, value in b["model"].items())

    layout = max_diff(hybrid, one)
    assert layout <= 20 * 0.1 * 2.0**-11 and max_diff(one, fp32) > layout
    assert hybrid["scaler"] == one["scaler"] and one["scaler"]["_growth_tracker"] == 20  # no overflow here


def test_sgd_from_a_job_file_equals_one_device(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("strategy: {name: mirrored, replicas: 2, embeddings: ps}\n"
                   "ps: {tasks: 1, partition_mb: 1}\n"
                   "training: {steps: 20}\n")
    printed = run_cli("train", RECOMMENDER, "--config", str(job), "--print-config")
    assert printed.returncode == 0 and "embeddings: ps" in printed.stdout, printed.stderr[-2000:]
    _train(RECOMMENDER, "--config", str(job), "--checkpoint-dir", str(tmp_path / "hybrid"), "--", "--optimizer", "sgd")
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", "--checkpoint-dir", str(tmp_path / "one"),
           "--", "--optimizer", "sgd")
    hybrid, one = _checkpoint(tmp_path / "hybrid"), _checkpoint(tmp_path / "one")
    assert one["optimizer"]["state"] == {}  # plain SGD keeps none
    _assert_same_training(hybrid, one)


def test_clip_grad_norm_takes_in_the_rows_and_equals_one_device(tmp_path: Path) -> None:
    """One global norm over the dense gradients and every table's rows, gathered from both replicas
    (the category rows meet across them): one-device's clip. The clip must bite (the unclipped
    run ends elsewhere), and a norm without the rows (the dense part alone) would scale less."""
    clip = ("--clip-grad-norm", "0.05")
    _train(RECOMMENDER, *HYBRID, "--ps-tasks", "2", "--ps-partition-mb", "0.001", "--steps", "20", *clip,
           "--checkpoint-dir", str(tmp_path / "hybrid"), "--", "--optimizer", "sgd")
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", *clip, "--checkpoint-dir", str(tmp_path / "one"),
           "--", "--optimizer", "sgd")
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", "--checkpoint-dir", str(tmp_path / "free"),
           "--", "--optimizer", "sgd")
    hybrid, one, free = (_checkpoint(tmp_path / name) for name in ("hybrid", "one", "free"))
    _assert_same_training(hybrid, one)
    moved = max((free["model"][key] - value).abs().max().item() for key, value in one["model"].items())
    assert moved > 1e-3, moved


def test_resume_on_another_ps_layout_sends_the_tables_back_and_ends_as_one_device(tmp_path: Path) -> None:
    """10 steps on two dense replicas with the user table on one ps task, then --resume to 20 on
    one dense replica with every table split over two ps tasks: the chief sends each ps task its
    rows of the tables and of Adagrad's sums. The checkpoint exports as the recipe's plain model."""
    ckpt = tmp_path / "hybrid"
    _train(RECOMMENDER, *HYBRID, "--ps-tasks", "1", "--ps-partition-mb", "1", "--steps", "10",
           "--checkpoint-dir", str(ckpt))
    lines = _train(RECOMMENDER, "--strategy", "mirrored", "--replicas", "1", "--embeddings", "ps", "--ps-tasks", "2",
                   "--ps-partition-mb", "0.001", "--steps", "20", "--resume", "--checkpoint-dir", str(ckpt))
    steps = [line["step"] for line in lines if line.get("type") == "step"]
    assert min(steps) == 11 and lines[-1]["steps"] == 20 and lines[-1]["replicas"] == 1
    _train(RECOMMENDER, "--strategy", "one-device", "--steps", "20", "--checkpoint-dir", str(tmp_path / "one"))
    _assert_same_training(_checkpoint(ckpt), _checkpoint(tmp_path / "one"))
    exported = run_cli("checkpoint", "export", str(ckpt), "-o", str(tmp_path / "model.pt"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    plain = _recipe_model()
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # strict: tables included
    torch.testing.assert_close(plain.users.weight.detach(), _checkpoint(tmp_path / "one")["model"]["users.weight"],
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("partition_mb", ["0.1", "0.001"], ids=["items-with-ddp", "every-table-on-ps"])
def test_sparse_adam_on_a_factorisation_model_equals_one_device(tmp_path: Path, partition_mb: str) -> None:
    """recipes/factorization.py: two sparse tables and torch.optim.SparseAdam, whose moments are kept
    and moved per row. The user table on the ps task, the item table with DDP (its sparse gradients
    all-reduced), or both tables on the ps task and nothing left for DDP: one device's parameters
    and SparseAdam's moments."""
    recipe = str(REPO / "recipes" / "factorization.py")
    lines = _train(recipe, *HYBRID, "--ps-tasks", "1", "--ps-partition-mb", partition_mb, "--steps", "20",
                   "--checkpoint-dir", str(tmp_path / "hybrid"))
    placement = [line["line"] for line in lines if line.get("type") == "output" and "[placement]" in line["line"]]
    assert any("users.weight[0:20000]" in p for p in placement), placement
    assert any("items.weight" in p for p in placement) == (partition_mb == "0.001"), placement
    # The step's wait for the other replicas: timed around DDP's all-reduce; with no DDP (both tables
    # on the ps task) it is in the push, which the clock does not time: said unmeasured, never 0.
    waits = {line["compute_ms"] is None for line in lines if line.get("type") == "step" and line["step"] > 1}
    assert waits == {partition_mb == "0.001"}, waits
    _train(recipe, "--strategy", "one-device", "--steps", "20", "--checkpoint-dir", str(tmp_path / "one"))
    hybrid, one = _checkpoint(tmp_path / "hybrid"), _checkpoint(tmp_path / "one")
    assert hybrid["step"] == one["step"] == 20
    for key, tensor in one["model"].items():
        torch.testing.assert_close(hybrid["model"][key], tensor, rtol=0, atol=1e-6, msg=key)
    for index, state in one["optimizer"]["state"].items():  # the users' moments, from the ps task
        for key, value in state.items():
            torch.testing.assert_close(hybrid["optimizer"]["state"][index][key], value, rtol=0, atol=1e-6,
                                       msg=f"{index}.{key}")


def test_elastic_with_every_table_on_the_ps_tasks_is_one_line() -> None:
    """Nothing left for DDP on the replicas (both tables on the ps task): no round could heal them."""
    result = run_cli("train", str(REPO / "recipes" / "factorization.py"), *HYBRID, "--ps-tasks", "1",
                     "--ps-partition-mb", "0.001", "--elastic", "1:2", "--steps", "4")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "--embeddings ps --elastic: every parameter of the recipe's model is a table on the ps tasks" in last, last
    assert "Traceback" not in result.stderr


def test_an_optimizer_that_moves_untouched_rows_is_one_line() -> None:
    result = run_cli("train", RECOMMENDER, *HYBRID, "--ps-tasks", "1", "--ps-partition-mb", "1", "--steps", "5",
                     "--", "--optimizer", "adam")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and "--embeddings ps" in errors[0] and "Adam" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_custom_loop_recipe_is_one_line_exit_3() -> None:
    """The ps tasks build the tables and their optimizer from the recipe's model() and optimizer()."""
    result = run_cli("train", str(REPO / "recipes" / "custom_loop.py"), *HYBRID, "--ps-tasks", "1")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 3 and len(errors) == 1 and "trains fit-style recipes" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_which_optimizers_update_row_by_row() -> None:
    """The rule the refusal applies: a row no step looked up must come out as it went in."""
    from distrun.strategies.ps.tables import rowwise_refusal

    table, dense = torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(2))
    assert rowwise_refusal(torch.optim.SGD([table, dense], lr=0.1), [table]) is None
    assert rowwise_refusal(torch.optim.Adagrad([table], lr=0.1, initial_accumulator_value=0.1), [table]) is None
    assert rowwise_refusal(torch.optim.SparseAdam([table], lr=0.1), [table]) is None
    assert "SGD with momentum=0.9" in rowwise_refusal(torch.optim.SGD([table], lr=0.1, momentum=0.9), [table])
    assert "Adagrad with weight_decay=0.01" in rowwise_refusal(torch.optim.Adagrad([table], weight_decay=0.01), [table])
    assert "AdamW keeps state" in rowwise_refusal(torch.optim.AdamW([table]), [table])
    # Only the groups that hold a table count: the dense layers may use anything.
    assert rowwise_refusal(torch.optim.SGD([{"params": [table]}, {"params": [dense], "momentum": 0.9}], lr=0.1),
                           [table]) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--strategy", "sharded", "--embeddings", "ps", "--ps-tasks", "1"),
         "--embeddings ps: for --strategy mirrored or multi-worker"),
        (("--strategy", "diloco", "--embeddings", "ps", "--ps-tasks", "1"),
         "--embeddings ps: for --strategy mirrored or multi-worker"),
        (("--strategy", "ps", "--embeddings", "ps", "--ps-tasks", "1"),
         "--embeddings ps: for --strategy mirrored or multi-worker"),
        (("--strategy", "mirrored", "--embeddings", "ps", "--ps-tasks", "0"), "--embeddings ps needs ps tasks"),
        (("--strategy", "mirrored", "--embeddings", "ps", "--ps-tasks", "1", "--ps-sync"),
         "--ps-sync with --embeddings ps"),
        (("--strategy", "mirrored", "--embeddings", "rows"), "--embeddings: expected dense or ps"),
        (("--strategy", "mirrored", "--ps-tasks", "1"), "--ps-tasks is for --strategy parameter-server"),
    ],
)
def test_where_embeddings_ps_does_not_apply_is_one_line_exit_2(args: tuple[str, ...], message: str) -> None:
    result = run_cli("train", RECOMMENDER, *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, result.stderr


def test_the_live_view_and_the_summary_show_the_bytes_a_step() -> None:
    """Each replica's newest figures, their mean in the summary and a line under the live tables;
    a job whose Step events carry none (any other strategy) shows neither."""
    from rich.console import Console

    from distrun.client._tracker import JobTracker
    from distrun.protocol import Step
    from distrun.ui import render_progress, render_summary

    def step(rank: int, embedding: float | None, dense: float | None) -> Step:
        return Step(rank=rank, time=1.0, step=5, epoch=0, loss=0.5, samples_per_s=10.0, mem_mb=1.0,
                    embedding_bytes_per_step=embedding, dense_grad_bytes_per_step=dense)

    def text(renderable: Any) -> str:
        console = Console(width=200, record=True, color_system=None)
        console.print(renderable)
        return console.export_text()

    tracker = JobTracker("recommender.py", "mirrored", replicas=2, ps_tasks=1)
    tracker.update(step(0, 4000.0, 5380.0))
    tracker.update(step(1, 4200.0, 5380.0))
    assert ("embeddings ps: a step moves 4.1 KB of rows pulled and pushed, 5.4 KB of dense gradients all-reduced"
            in text(render_progress(tracker.snapshot())))
    summary = tracker.summary("succeeded")
    assert summary.embedding_bytes_per_step == 4100.0 and summary.dense_grad_bytes_per_step == 5380.0
    assert "4,100 B of embedding rows pulled and pushed, 5,380 B of dense gradients" in text(render_summary(summary))
    plain = JobTracker("recommender.py", "mirrored", replicas=2)
    plain.update(step(0, None, None))
    assert plain.summary("succeeded").embedding_bytes_per_step is None
    assert "bytes a step" not in text(render_summary(plain.summary("succeeded")))
    assert "embeddings ps" not in text(render_progress(plain.snapshot()))
