"""Model parallelism's pieces that need no process group: the flags' refusals, the mesh's shape
and each rank's place in it, the tensor-parallel plan's checks, and what activation
checkpointing keeps for backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distrun.client._tracker import JobTracker
from distrun.config import JobSpec, StrategyName
from distrun.errors import ConfigError, RecipeError
from distrun.protocol import describe_mesh, mesh_place
from distrun.strategies.parallel.activation import checkpoint_units
from distrun.strategies.parallel.mesh import MeshShape, mesh_shape
from distrun.strategies.parallel.plan import resolve_plan
from distrun.strategies.parallel.plan_check import agree


def _spec(strategy: str, **kwargs) -> JobSpec:
    return JobSpec.of(recipe="/r.py", strategy=StrategyName.parse(strategy), **kwargs)


def test_a_replica_spans_tp_ranks():
    spec = _spec("sharded", replicas=2, tp=2)
    assert spec.world_size == 4 and spec.trainer_ranks == 4 and spec.mesh == {"dp": 2, "tp": 2, "pp": 1}
    assert _spec("mirrored", replicas=3).world_size == 3  # one rank a replica, as before


@pytest.mark.parametrize("strategy, extra, says", [
    ("one-device", {}, "--tp with --strategy one-device: one-device runs one rank"),
    ("central-storage", {"replicas": 2}, "--tp with --strategy central-storage"),
    ("parameter-server", {"replicas": 2, "ps_tasks": 1}, "--tp with --strategy parameter-server"),
    ("mirrored", {"replicas": 2, "elastic_min": 1, "elastic_max": 2}, "--tp with --elastic"),
    ("mirrored", {"replicas": 2, "compression": "bf16"}, "--compression with --tp"),
    ("mirrored", {"replicas": 2, "sync_batch_norm": True}, "--sync-batch-norm with --tp"),
    ("mirrored", {"tp": 0}, "--tp: expected a positive whole number"),
    ("multi-worker", {"replicas": 2, "allreduce": "hierarchical"}, "--allreduce with --tp: it configures DDP's"),
    ("central-storage", {"replicas": 2, "tp": 1, "pp": 2}, "--pp with --strategy central-storage: its replicas hold"),
    ("parameter-server", {"replicas": 2, "ps_tasks": 1, "tp": 1, "pp": 2}, "--pp with --strategy parameter-server"),
    ("diloco", {"replicas": 2, "tp": 1, "pp": 2}, "--pp with --strategy diloco: each replica steps alone"),
])
def test_what_tp_cannot_do_is_refused_in_one_line(strategy, extra, says):
    with pytest.raises(ConfigError, match="^" + says.replace("(", r"\(").replace("*", r"\*")) as caught:
        _spec(strategy, **{"tp": 2, **extra})
    assert "\n" not in str(caught.value)


def test_a_clusters_slots_that_do_not_split_into_replicas_are_refused_naming_the_file():
    from distrun.cli._spec import replicas_of
    from distrun.errors import UsageError

    assert replicas_of(4, 2, "lab.yaml") == 2 and replicas_of(3, 1, "lab.yaml") == 3
    with pytest.raises(UsageError, match=r"^--tp x --pp = 2: lab.yaml has 3 worker slot\(s\), which do not split "
                                         r"into replicas of 2 ranks; give the workers a multiple of 2 slots$"):
        replicas_of(3, 2, "lab.yaml")


def test_activation_checkpointing_values_are_checked():
    with pytest.raises(ConfigError, match="--activation-checkpointing: expected none, full, selective"):
        _spec("mirrored", replicas=2, activation_checkpointing="some")
    with pytest.raises(ConfigError, match="--activation-checkpointing with --strategy parameter-server"):
        _spec("ps", replicas=2, ps_tasks=1, activation_checkpointing="full")


def test_the_mesh_puts_tensor_parallel_innermost():
    """Consecutive ranks (one host's) share a tensor-parallel group; replicas go across."""
    shape = mesh_shape(8, tp=2, sharded=True, shard_within="auto", hosts=2)
    assert shape == MeshShape(dp_shard=4, tp=2) and shape.dp == 4
    assert [(shape.place(r)["dp"], shape.place(r)["tp"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(shape.place(r)["dp"] == mesh_place(r, {"dp": 4, "tp": 2})["dp"] for r in range(8))
    # HSDP under --tp: shard over a host's replicas, replicate across hosts.
    assert mesh_shape(8, tp=2, sharded=True, shard_within="host", hosts=2) == MeshShape(dp_replicate=2, dp_shard=2,
                                                                                       tp=2)
    assert mesh_shape(4, tp=2, sharded=False, shard_within="auto", hosts=1) == MeshShape(dp_replicate=2, tp=2)
    assert mesh_shape(4, tp=2, sharded=False, shard_within="auto", hosts=1).describe() == "dp 2 x tp 2 (dp replicated)"
    assert describe_mesh({"dp": 2, "tp": 2}) == "dp 2 x tp 2"


def test_a_tensor_parallel_group_never_crosses_hosts():
    with pytest.raises(ConfigError, match="a tensor-parallel group stays inside one host, and each host runs 1"):
        mesh_shape(2, tp=2, sharded=False, shard_within="auto", hosts=2)
    with pytest.raises(ConfigError, match="do not split into replicas of 2"):
        mesh_shape(3, tp=2, sharded=False, shard_within="auto", hosts=1)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.0), nn.Linear(32, 8))


class _Grouped(nn.Module):
    """Attention with fewer k/v heads, SwiGLU in LLaMA's order (w1, w2, w3), and two modules whose
    Linears are no projection group (a classifier's stack; two readers of different widths)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.q, self.attn.k, self.attn.v, self.attn.o = (nn.Linear(16, 16), nn.Linear(16, 4),
                                                               nn.Linear(16, 4), nn.Linear(16, 16))
        self.ffn = nn.Module()
        self.ffn.w1, self.ffn.w2, self.ffn.w3 = nn.Linear(16, 48), nn.Linear(48, 16), nn.Linear(16, 48)
        self.norm = nn.LayerNorm(16)
        self.stack = nn.Module()
        self.stack.fc1, self.stack.fc2, self.stack.fc3 = nn.Linear(784, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        self.mixed = nn.Module()
        self.mixed.a, self.mixed.b, self.mixed.c = nn.Linear(16, 8), nn.Linear(12, 8), nn.Linear(8, 16)


def test_a_derived_plan_splits_mlp_pairs_and_projection_groups_and_says_it_checks_the_second():
    plan = resolve_plan(_Attention(), None, 2)
    assert dict(plan.styles) == {"mlp.0": "colwise", "mlp.3": "rowwise", "q": "colwise", "o": "rowwise"}
    assert plan.checked and "checked on the first batch" in plan.description
    grouped = resolve_plan(_Grouped(), None, 2)
    assert dict(grouped.styles) == {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise",
                                    "attn.o": "rowwise", "ffn.w1": "colwise", "ffn.w3": "colwise",
                                    "ffn.w2": "rowwise"}
    # Under --pp no whole model stays to check against: only the nn.Sequential pairs, which are sure.
    piped = resolve_plan(_Attention(), None, 2, can_check=False)
    assert dict(piped.styles) == {"mlp.0": "colwise", "mlp.3": "rowwise"} and not piped.checked
    assert resolve_plan(_Attention(), lambda model: {"q": "colwise"}, 2).checked is False  # the recipe's own
    # A group whose splits --tp does not divide (k and v write 4 features) is left whole.
    assert "attn.q" not in resolve_plan(_Grouped(), None, 8).styles


def test_the_plan_line_names_alike_layers_once_with_their_count():
    blocks = nn.ModuleList(_Attention() for _ in range(3))
    plan = resolve_plan(nn.Sequential(*blocks), None, 2)
    assert "*.mlp.0 colwise (3), *.mlp.3 rowwise (3), *.q colwise (3), *.o rowwise (3)" in plan.description


def test_nothing_to_split_is_refused_naming_tp_plan():
    with pytest.raises(RecipeError, match=r"--tp: distrun found no layer it can split safely .* define tp_plan"):
        resolve_plan(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)), None, 2)


def test_outputs_agree_within_the_tolerance_of_their_precision():
    whole = [torch.randn(4, 8), torch.randn(3)]
    assert agree([t + 1e-6 for t in whole], whole)[0] is None
    problem, worst = agree([whole[0] * 1.05, whole[1]], whole)  # a head of the wrong size: ~5% off
    assert problem and "differ from the whole model's by 0.05" in problem and worst == pytest.approx(0.05, rel=1e-4)
    half = [t.bfloat16() for t in whole]
    assert agree(half, whole)[0] is None  # bf16 rounding is allowed for
    assert "shapes [(4, 4), (3,)]" in agree([whole[0][:, :4], whole[1]], whole)[0]


@pytest.mark.parametrize("plan, says", [
    ({"qq": "colwise"}, "tp_plan['qq']: matches no module of the model (did you mean 'q'?)"),
    ({"mlp.1": "colwise"}, "tp_plan['mlp.1']: colwise splits nn.Linear and nn.Embedding; mlp.1 is a ReLU"),
    ({"q": "sideways"}, "tp_plan['q']: expected colwise, rowwise, output, sequence, replicate or a torch "
                          "ParallelStyle"),
    ({"q": "colwise", "[qo]": "rowwise"}, "tp_plan: q is matched by 'q' (colwise) and by '[qo]' (rowwise)"),
    ({"mlp.0": "colwise"}, None),
])
def test_a_recipe_plan_is_checked_against_the_model(plan, says):
    if says is None:
        assert resolve_plan(_Attention(), lambda model: plan, 4).styles == plan
        with pytest.raises(RecipeError, match=r"tp_plan\['mlp.0'\]: mlp.0's 32 output features do not split over --tp 3"):
            resolve_plan(_Attention(), lambda model: plan, 3)
        return
    with pytest.raises(RecipeError) as caught:
        resolve_plan(_Attention(), lambda model: plan, 2)
    assert str(caught.value).startswith(says), caught.value


def test_tied_weights_are_refused_under_tp():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight
    with pytest.raises(RecipeError, match="0.weight and 1.weight are one tensor"):
        resolve_plan(model, lambda m: {"1": "colwise"}, 2)


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward."""
    kept = []

    def pack(tensor):
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x).sum().backward()
    return sum(kept)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_less_and_computes_the_same(mode):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.Tanh())
                               for _ in range(4)])

    x = torch.randn(32, 64)
    plain, checkpointed = build(), build()
    assert checkpoint_units(list(checkpointed), mode) == 4
    kept_plain, kept_checkpointed = _saved_bytes(plain, x), _saved_bytes(checkpointed, x)
    assert kept_checkpointed < kept_plain * (0.5 if mode == "full" else 0.9), (kept_checkpointed, kept_plain)
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    # The units keep their names: a checkpoint moves between jobs with and without it.
    assert [name for name, _ in checkpointed.named_parameters()] == [name for name, _ in plain.named_parameters()]


def test_the_summary_counts_replicas_not_ranks():
    tracker = JobTracker("r.py", "sharded", 4, mesh={"dp": 2, "tp": 2})
    summary = tracker.summary("succeeded")
    assert summary.replicas == 2 and summary.mesh == {"dp": 2, "tp": 2} and len(tracker.snapshot().rows) == 4


def test_the_live_view_shows_the_mesh_and_each_ranks_place():
    from rich.console import Console

    from distrun.ui.train import render_progress, render_summary

    tracker = JobTracker("r.py", "mirrored", 4, mesh={"dp": 2, "tp": 2})
    console = Console(width=100, record=True)
    console.print(render_progress(tracker.snapshot()))
    console.print(render_summary(tracker.summary("succeeded")))
    text = console.export_text()
    assert "r.py · mirrored · dp 2 x tp 2" in text
    rows = [line.split("│") for line in text.splitlines() if line.startswith("│") and "starting" in line]
    assert [(cells[1].strip(), cells[2].strip()) for cells in rows] == [
        ("0", "dp0 tp0"), ("1", "dp0 tp1"), ("2", "dp1 tp0"), ("3", "dp1 tp1")]
    assert "mirrored × 2 (dp 2 x tp 2, 4 ranks)" in text
    # Pipelined: stages outermost, and the summary's mesh names every degree.
    piped = JobTracker("r.py", "sharded", 8, mesh={"dp": 2, "tp": 2, "pp": 2})
    console = Console(width=100, record=True)
    console.print(render_progress(piped.snapshot()))
    text = console.export_text()
    assert "r.py · sharded · dp 2 x tp 2 x pp 2" in text
    rows = [line.split("│") for line in text.splitlines() if line.startswith("│") and "starting" in line]
    assert [cells[2].strip() for cells in rows][3:6] == ["dp1 tp1 pp0", "dp0 tp0 pp1", "dp0 tp1 pp1"]
    assert piped.summary("succeeded").replicas == 2


@pytest.mark.parametrize("extra, says", [
    ({"pp": 2, "microbatches": 1}, "--microbatches 1: 1F1B needs at least one microbatch per stage (2)"),
    ({"pp": 2, "global_batch_size": 6}, "--microbatches 4: a replica's batch of 6"),
    ({"pp": 2, "pp_schedule": "wavy"}, "--pp-schedule: expected gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv, "
                                       "dualpipe-v"),
    ({"sequence_parallel": True}, "--sequence-parallel splits the activations"),
    ({"loss_parallel": True}, "--loss-parallel computes the loss on each tensor-parallel rank's slice"),
    ({"tp": 2, "pp": 2, "loss_parallel": True}, "--loss-parallel with --pp: not yet"),
    ({"pp": 2, "pp_schedule": "zbv", "compile": True}, "--compile with --pp-schedule zbv: its backward is split"),
    ({"pp": 2, "pp_schedule": "dualpipe-v", "microbatches": 2},
     "--microbatches 2: DualPipeV needs at least one microbatch per stage (4: two stages a rank)"),
    ({"pp_schedule": "gpipe"}, "--pp-schedule is for pipeline parallel: it needs --pp 2 or more"),
    ({"microbatches": 4}, "--microbatches is for pipeline parallel"),
    ({"pp": 2, "precision": "fp16"}, "--precision fp16 with --pp"),
    ({"pp": 2, "elastic_min": 1, "elastic_max": 2}, "--pp with --elastic"),
])
def test_what_pp_cannot_do_is_refused_in_one_line(extra, says):
    with pytest.raises(ConfigError) as caught:
        _spec("mirrored", **{"global_batch_size": 8, **extra})
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value), caught.value


def test_a_pipelined_replica_spans_tp_x_pp_ranks():
    spec = _spec("sharded", replicas=2, tp=2, pp=2, global_batch_size=8)
    assert spec.world_size == 8 and spec.mesh == {"dp": 2, "tp": 2, "pp": 2}
    assert spec.parallel.pipeline_microbatches == 4
    # Stages outermost: ranks 0-3 (one host's, with 4 slots) hold stage 0, ranks 4-7 stage 1.
    assert [mesh_place(rank, spec.mesh)["pp"] for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert mesh_place(5, spec.mesh) == {"dp": 0, "tp": 1, "pp": 1}


def test_the_chain_is_cut_where_the_heaviest_stage_is_lightest():
    from distrun.strategies.parallel.pipeline import Chain, chain_of, cut_chain

    chain = Chain(tuple("abcdef"), (10, 10, 10, 10, 10, 50), "test")
    assert cut_chain(chain, 2).bounds == (0, 5, 6)  # 50 alone, the rest together
    assert cut_chain(chain, 3).bounds[-2:] == (5, 6)
    assert cut_chain(Chain(tuple("abcd"), (1, 1, 1, 1), "test"), 4).bounds == (0, 1, 2, 3, 4)
    with pytest.raises(RecipeError, match="has 2 module.s., fewer than the 3 pipeline stages"):
        cut_chain(Chain(("a", "b"), (1, 1), "test"), 3)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert chain_of(model, None).names == ("0", "1", "2")
    with pytest.raises(RecipeError, match="pp_chain.model.: a module appears twice"):
        chain_of(model, lambda m: [m[0], m[0], m[2]])
    with pytest.raises(RecipeError, match="pp_chain.model. leaves out 2.weight"):
        chain_of(model, lambda m: [m[0], m[1]])


def test_a_stage_keeps_the_whole_models_names():
    from distrun.strategies.parallel.pipeline import chain_of, check_chain, keep_stages, meta_copy

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    chain = chain_of(model, None)
    stage = keep_stages(meta_copy(model), chain, range(2, 5))
    assert [name for name, _ in stage.named_parameters()] == ["2.weight", "2.bias", "4.weight", "4.bias"]
    assert all(p.is_meta for p in stage.parameters()) and not any(p.is_meta for p in model.parameters())
    assert check_chain(model, chain, torch.randn(3, 4)) is None
    assert "does not compose" in check_chain(model, chain_of(model, lambda m: [m[0], m[2], m[4]]), torch.randn(3, 4))


def test_a_tracked_run_records_its_layout(tmp_path):
    from distrun.runtime.tracking import RunParams

    recipe = tmp_path / "r.py"
    recipe.write_text("")
    spec = JobSpec.of(recipe=str(recipe), strategy=StrategyName.SHARDED, replicas=2, tp=2, pp=2,
                   pp_schedule="gpipe", global_batch_size=8, activation_checkpointing="full")
    params = RunParams.from_spec(spec, world_size=8, tf_config=None).as_dict()
    assert (params["tp"], params["pp"], params["pp_schedule"], params["microbatches"]) == (2, 2, "gpipe", 4)
    assert params["activation_checkpointing"] == "full"
    plain = RunParams.from_spec(JobSpec.of(recipe=str(recipe)), world_size=1, tf_config=None).as_dict()
    assert "pp_schedule" not in plain and plain["tp"] == 1


def test_the_evaluator_role_runs_one_device_whatever_the_layout():
    from distrun.config import evaluator_spec

    evaluator = evaluator_spec(_spec("sharded", replicas=2, tp=2, pp=2, pp_schedule="gpipe", global_batch_size=8))
    assert evaluator.world_size == 1 and evaluator.strategy.name is StrategyName.ONE_DEVICE and evaluator.mesh == {
        "dp": 1, "tp": 1, "pp": 1}
    # What one-device refuses goes too: each of these made the evaluator host's spec invalid.
    for strategy, flat in (("multi-worker", {"compression": "fp16"}), ("multi-worker", {"allreduce": "hierarchical"}),
                           ("sharded", {"shard_within": "host", "async_checkpoint": True, "checkpoint_dir": "/c"}),
                           ("mirrored", {"checkpoint_dir": "/c", "preemptible": True, "precision": "bf16"})):
        evaluator = evaluator_spec(_spec(strategy, replicas=2, global_batch_size=8, **flat))
        assert evaluator.strategy.name is StrategyName.ONE_DEVICE and evaluator.training.global_batch_size == 8
        assert evaluator.precision.name == flat.get("precision", "fp32")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipe-v"])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_every_stage_has_one_rank_and_a_v_turns_on_the_last_rank(schedule: str, pp: int) -> None:
    from distrun.config._parallel import rank_of_stage, stages_of_rank, stages_per_rank

    held = {stage: rank for rank in range(pp) for stage in stages_of_rank(schedule, rank, pp)}
    assert sorted(held) == list(range(pp * stages_per_rank(schedule)))
    assert all(rank_of_stage(schedule, stage, pp) == rank for stage, rank in held.items())
    if schedule in ("zbv", "dualpipe-v"):  # the first and the last stage on rank 0; the turn local
        assert held[0] == held[2 * pp - 1] == 0 and held[pp - 1] == held[pp] == pp - 1
    elif stages_per_rank(schedule) == 2:  # looped: rank r holds r and r + P
        assert held[pp] == 0

