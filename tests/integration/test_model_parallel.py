"""``--tp`` and ``--pp`` (tensor and pipeline parallel, alone, together, and with mirrored/sharded
data parallelism) and ``--activation-checkpointing``, on real gloo groups on the CPU:
one-device's parameters after the same steps, checkpoints that move between layouts both
ways, and one-line refusals."""

from __future__ import annotations

import shutil

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]


#: A two-block transformer (attention and an MLP per block) small enough for 4 ranks on 2 cores:
#: every layer the plan names splits over 2 ranks; embeddings, norms and the head stay whole.
TRANSFORMER = """
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 8, "seed": 0}
VOCAB, WIDTH, HEADS, LENGTH = 16, 16, 4, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.norm1 = nn.LayerNorm(WIDTH)
        # No bias on k: softmax ignores it, so its gradient is float noise, which Adam would
        # turn into full-size steps that differ between any two layouts.
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH, bias=name != "k") for name in "qkv")
        self.o = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (layer(h).view(b, t, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model():
    return Net()


def pp_chain(net):
    return [net.embed, *net.blocks, net.head]


def tp_plan(net):
    return {"blocks.*.[qkv]": "colwise", "blocks.*.o": "rowwise", "blocks.*.mlp.0": "colwise",
            "blocks.*.mlp.2": "rowwise"}


def optimizer(params):
    return torch.optim.AdamW(params, lr=0.01)


def loss(outputs, batch):
    return F.cross_entropy(outputs.reshape(-1, VOCAB), batch[1].reshape(-1))


def _tokens(seed, count):
    rows = torch.randint(0, VOCAB, (count, LENGTH + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(rows[:, :-1], rows[:, 1:])


def train_data(ctx):
    return _tokens(1, 64)


def eval_data(ctx):
    return _tokens(2, 16)
"""

#: The issue's bound for every synchronous strategy against one-device after the same steps.
TOLERANCE = 2e-4
STEPS = ("--steps", "8", "--clip-grad-norm", "0.5")  # one epoch: evaluation runs at its end


def _train(recipe, ckpt, *flags):
    result = run_cli("train", str(recipe), "--json", "--checkpoint-dir", str(ckpt), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, load_checkpoint(latest_checkpoint(ckpt))


def _close(a, b, what):
    assert set(a) == set(b), f"{what}: {sorted(set(a) ^ set(b))}"
    for key, tensor in b.items():
        torch.testing.assert_close(a[key], tensor, rtol=0, atol=TOLERANCE, msg=f"{what}: {key}")


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    recipe = folder / "transformer.py"
    recipe.write_text(TRANSFORMER)
    return recipe


@pytest.fixture(scope="module")
def one_device(transformer, tmp_path_factory):
    """The reference: 8 steps on one device, a checkpoint at step 4 (for resumes) and at 8."""
    ckpt = tmp_path_factory.mktemp("one")
    result, data = _train(transformer, ckpt, *STEPS, "--checkpoint-every", "4", "--keep-checkpoints", "2")
    return result, data, ckpt


# The transformer under --sequence-parallel: the embedding hands out slices of the sequence, the
# norms run on them, the head gathers them back; the forward reads the length off q's output
# (a slice's x holds LENGTH / tp positions). The model and its parameters are the same.
SEQUENCE_PARALLEL = TRANSFORMER.replace(
    "        b, t, _ = x.shape\n        h = self.norm1(x)\n"
    "        q, k, v = (layer(h).view(b, t, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))\n",
    "        h = self.norm1(x)\n        q, k, v = (layer(h) for layer in (self.q, self.k, self.v))\n"
    "        b, t = q.shape[:2]\n"
    "        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))\n").replace(
    '"blocks.*.mlp.2": "rowwise"}',
    '"blocks.*.mlp.2": "rowwise",\n            "embed": "rowwise", "blocks.*.norm[12]": "sequence", "head": "output"}')


def test_sequence_and_loss_parallel_end_with_one_devices_parameters_and_a_missed_norm_is_named(one_device,
                                                                                                tmp_path):
    """--tp 2 --sequence-parallel --loss-parallel: the activations between the split layers are
    slices of the sequence, the loss is computed on each rank's slice of the logits; the
    parameters are one-device's. A norm left out of the plan is named on step 1."""
    assert SEQUENCE_PARALLEL.count("sequence") == 1 and "q.shape[:2]" in SEQUENCE_PARALLEL
    recipe = tmp_path / "sequence.py"
    recipe.write_text(SEQUENCE_PARALLEL)
    reference, one, _ = one_device
    result, data = _train(recipe, tmp_path / "sp", "-s", "mirrored", "--tp", "2", "--replicas", "2",
                          "--sequence-parallel", "--loss-parallel", *STEPS)
    _close(data["model"], one["model"], "mirrored --tp 2 --sequence-parallel --loss-parallel vs one-device")
    assert result.summary["final_loss"] == pytest.approx(reference.summary["final_loss"], abs=TOLERANCE)
    assert result.summary["eval_metrics"]["loss"] == pytest.approx(reference.summary["eval_metrics"]["loss"],
                                                                   abs=TOLERANCE)
    said = [line["line"] for line in result.json_lines() if line["type"] == "output" and "mesh dp" in line["line"]]
    assert "blocks.*.norm[12] sequence (4), head output, sequence parallel, loss parallel" in said[0], said
    missed = tmp_path / "missed.py"
    missed.write_text(SEQUENCE_PARALLEL.replace('"blocks.*.norm[12]": "sequence", ', ""))
    refused = run_cli("train", str(missed), "-s", "mirrored", "--tp", "2", "--sequence-parallel", *STEPS)
    assert refused.returncode == 3, refused.stderr[-2000:]
    assert ("--sequence-parallel: blocks.0.norm1 took a slice of the sequence but is not in tp_plan"
            in refused.stderr.strip().splitlines()[-1]), refused.stderr[-2000:]


@pytest.mark.parametrize("strategy, flags, mesh", [
    ("mirrored", ("--tp", "2"), {"dp": 1, "tp": 2, "pp": 1}),
    ("sharded", ("--tp", "2", "--replicas", "2"), {"dp": 2, "tp": 2, "pp": 1}),
    ("mirrored", ("--tp", "2", "--replicas", "2", "--activation-checkpointing", "selective"), {"dp": 2, "tp": 2, "pp": 1}),
])
def test_tensor_parallel_ends_with_one_devices_parameters(transformer, one_device, tmp_path, strategy, flags, mesh):
    reference, one, _ = one_device
    result, data = _train(transformer, tmp_path / "ck", "-s", strategy, *flags, *STEPS)
    _close(data["model"], one["model"], f"{strategy} {' '.join(flags)} vs one-device")
    summary = result.summary
    assert summary["mesh"] == mesh and summary["replicas"] == mesh["dp"], summary
    assert summary["final_loss"] == pytest.approx(reference.summary["final_loss"], abs=TOLERANCE)
    assert summary["eval_metrics"]["loss"] == pytest.approx(reference.summary["eval_metrics"]["loss"], abs=TOLERANCE)
    assert sorted(summary["peak_mem_mb"]) == [str(rank) for rank in range(mesh["dp"] * mesh["tp"])]
    # The plan and the mesh, said once by rank 0: the recipe's patterns, each with its count.
    said = [line["line"] for line in result.json_lines() if line["type"] == "output" and "mesh dp" in line["line"]]
    assert len(said) == 1 and f"mesh dp {mesh['dp']} x tp 2" in said[0], said
    assert "the recipe's tp_plan: blocks.*.[qkv] colwise (6), blocks.*.o rowwise (2)" in said[0], said
    assert data["mesh"] == mesh and data["strategy"] == strategy
    # Every rank of a replica reads its batches: the job counts each replica's samples once. The
    # summary's rate (after step 1) against the global batch over rank 0's own step times: a
    # replica counted once per rank would read tp times too high.
    steps = {line["step"]: line["time"] for line in result.json_lines() if line["type"] == "step" and line["rank"] == 0}
    assert min(steps) == 1 and max(steps) == 8, sorted(steps)
    measured = 8 * (8 - 1) / (steps[8] - steps[1])
    assert 0.5 < summary["samples_per_s"] / measured < 1.5, (summary["samples_per_s"], measured)


def test_a_derived_plan_splits_attention_and_mlp_and_ends_with_one_devices_parameters(transformer, one_device,
                                                                                      tmp_path):
    """Without tp_plan: q, k, v and o by their shapes, the MLP pair in its nn.Sequential; the first
    batch confirms the split (the forward reads its heads off shapes), and training is one-device's."""
    recipe = tmp_path / "derived.py"
    recipe.write_text(transformer.read_text().replace("def tp_plan(net):", "def _no_plan(net):"))
    reference, one, _ = one_device
    result, data = _train(recipe, tmp_path / "ck", "-s", "mirrored", "--tp", "2", *STEPS)
    _close(data["model"], one["model"], "a derived plan vs one-device")
    said = [line["line"] for line in result.json_lines() if line["type"] == "output" and line["rank"] == 0]
    assert any("derived (the MLP pairs of nn.Sequential and each module's projections, checked on the first batch"
               in line and "blocks.*.q colwise (2), blocks.*.k colwise (2), blocks.*.v colwise (2), "
               "blocks.*.o rowwise (2)" in line for line in said), said
    assert any(line.startswith("[mirrored] the derived plan holds on the first batch") for line in said), said


def test_ranks_of_a_replica_draw_alike_and_keep_rank_0s_buffers(transformer, tmp_path):
    """Dropout outside the split layers must draw one mask on every rank of a replica, as one
    device would (each rank but 0 built its model on the meta device, drawing nothing), and a
    non-persistent buffer must hold rank 0's values after the model is split and allocated."""
    source = transformer.read_text().replace(
        "        self.head = nn.Linear(WIDTH, VOCAB)\n",
        "        self.head = nn.Linear(WIDTH, VOCAB)\n"
        "        self.register_buffer('scale', torch.linspace(0.5, 1.5, WIDTH), persistent=False)\n").replace(
        "        x = self.embed(tokens)\n",
        "        x = F.dropout(self.embed(tokens), 0.2, self.training) * self.scale\n")
    recipe = tmp_path / "dropout.py"
    recipe.write_text(source)
    _, one = _train(recipe, tmp_path / "one", *STEPS)
    _, tp = _train(recipe, tmp_path / "tp", "-s", "mirrored", "--tp", "2", *STEPS)
    _close(tp["model"], one["model"], "dropout and a non-persistent buffer under --tp 2")


def test_bf16_under_tp_and_pp_trains_like_fp32(transformer, one_device, tmp_path):
    """FSDP2's bf16 policy over the tensor-parallel stages: the loss within bf16's rounding of fp32's."""
    reference, one, _ = one_device
    result, data = _train(transformer, tmp_path / "bf16", "-s", "mirrored", "--tp", "2", "--pp", "2",
                          "--microbatches", "2", "--precision", "bf16", *STEPS)
    assert all(t.dtype == torch.float32 for t in data["model"].values())  # fp32 master weights
    assert result.summary["final_loss"] == pytest.approx(reference.summary["final_loss"], abs=0.05)
    # ...and bf16 did compute: fp32's parameters are not reached to its precision (a dropped
    # --precision would end within 2e-4 of them, as every fp32 layout does).
    drift = max(float((data["model"][key] - tensor).abs().max()) for key, tensor in one["model"].items())
    assert drift > TOLERANCE, drift


def test_a_tp_checkpoint_resumes_under_one_device_and_exports_whole(transformer, one_device, tmp_path):
    """dp 2 x tp 2 writes step 4; one-device resumes it to step 8, where the uninterrupted
    one-device run ended (one-device's checkpoints resume under --tp: the next test)."""
    _, one, _ = one_device
    _train(transformer, tmp_path / "tp", "-s", "sharded", "--tp", "2", "--replicas", "2", "--steps", "4",
           "--clip-grad-norm", "0.5")
    rows = run_cli("checkpoint", "ls", str(tmp_path / "tp"), "--json")
    assert rows.returncode == 0 and '"mesh": {"dp": 2, "tp": 2, "pp": 1}' in rows.stdout, rows.stdout
    exported = tmp_path / "export.pt"
    result = run_cli("checkpoint", "export", str(tmp_path / "tp"), "-o", str(exported))
    assert result.returncode == 0, result.stderr
    state = torch.load(exported, weights_only=True)
    assert sorted(state) == sorted(one["model"])  # the model's own names, whole tensors
    assert all(type(t) is torch.Tensor and t.shape == one["model"][k].shape for k, t in state.items())

    _, resumed = _train(transformer, tmp_path / "tp", *STEPS, "--resume")
    assert resumed["step"] == 8
    _close(resumed["model"], one["model"], "tp 2 x dp 2 -> one-device")


@pytest.mark.parametrize("layout, mode, blocks", [
    (("-s", "mirrored", "--replicas", "2"), "selective", "2 Block block(s) of blocks"),
    (("-s", "sharded", "--replicas", "2"), "full", "2 Block block(s) of blocks"),
    (("-s", "mirrored", "--pp", "2"), "full", "Block"),  # each stage's blocks
])
def test_activation_checkpointing_changes_no_parameter(transformer, one_device, tmp_path, layout, mode, blocks):
    _, one, _ = one_device
    result, data = _train(transformer, tmp_path / "ck", *layout, "--activation-checkpointing", mode, *STEPS)
    _close(data["model"], one["model"], f"{' '.join(layout)} --activation-checkpointing {mode}")
    said = [line["line"] for line in result.json_lines() if line["type"] == "output"
            and f"activation checkpointing ({mode})" in line["line"]]
    assert len(said) == 1 and blocks in said[0], said


# A custom loop that trains through strategy.forward_backward: the one call that runs under --pp
# too (a rank holds stages, which model(inputs) cannot run), and unchanged everywhere else.
CUSTOM_LOOP_PP = """import torch
from torch import nn
from torch.utils.data import TensorDataset


def _points(seed, n):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def main(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = strategy.prepare(model, optimizer)
    data = strategy.distribute_dataset(_points(42, 60), global_batch_size=8)

    def loss_fn(outputs, batch):
        return nn.functional.cross_entropy(outputs, batch[1])

    def step(batch):
        optimizer.zero_grad()
        loss = strategy.forward_backward(model, batch, loss_fn)
        optimizer.step()
        return loss

    for epoch in range(2):
        for batch in data:
            strategy.run(step, batch)
"""


def test_a_custom_loop_trains_a_pipeline_through_forward_backward(tmp_path):
    """Issue 31: a custom loop under --pp, its step `strategy.forward_backward(model, batch, loss_fn)`:
    every step's loss is one-device's, under 1f1b and the V-shaped zbv."""
    recipe = tmp_path / "loop.py"
    recipe.write_text(CUSTOM_LOOP_PP)
    losses = {}
    for name, flags in (("one", ("-s", "one-device")), ("zbv", ("-s", "mirrored", "--pp", "2", "--pp-schedule", "zbv"))):
        result = run_cli("train", str(recipe), *flags, "--json", "--log-interval-s", "0")
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = [line["loss"] for line in result.json_lines() if line["type"] == "step" and line["rank"] == 0]
    assert len(losses["one"]) == 16
    assert losses["zbv"] == pytest.approx(losses["one"], abs=TOLERANCE)


def test_a_custom_loop_that_calls_the_model_under_pp_is_told_how_to_step(tmp_path):
    recipe = tmp_path / "calls.py"
    recipe.write_text(CUSTOM_LOOP_PP.replace("loss = strategy.forward_backward(model, batch, loss_fn)",
                                             "loss = loss_fn(model(batch[0]), batch)\n        loss.backward()"))
    result = run_cli("train", str(recipe), "-s", "mirrored", "--pp", "2", "--json")
    assert result.returncode == 3, result.stderr[-2000:]
    assert ("--pp: a rank holds pipeline stages, which cannot be called as one model; "
            "strategy.forward_backward(...) trains a batch") in result.summary["error"], result.summary["error"]


def test_a_custom_loop_prepares_its_part(tmp_path):
    """recipes/custom_loop.py unchanged: its MLP split over 2 ranks per replica, the losses mirrored's."""
    runs = {tp: run_cli("train", str(REPO / "recipes" / "custom_loop.py"), "-s", "mirrored", "--replicas", "2",
                        "--tp", tp, "--json") for tp in ("1", "2")}
    for tp, result in runs.items():
        assert result.returncode == 0, f"--tp {tp}: {result.stderr[-3000:]}"
    assert runs["2"].summary["mesh"] == {"dp": 2, "tp": 2, "pp": 1}
    assert runs["2"].summary["steps"] == runs["1"].summary["steps"] == 24
    assert runs["2"].summary["final_loss"] == pytest.approx(runs["1"].summary["final_loss"], abs=TOLERANCE)


@pytest.mark.parametrize("plan, says", [
    ('{"blocks.*.qq": "colwise"}', "tp_plan['blocks.*.qq']: matches no module of the model"),
    ('{"blocks.*.norm1": "colwise"}', "tp_plan['blocks.*.norm1']: colwise splits nn.Linear and nn.Embedding"),
    (None, "--tp: the derived plan does not hold: its outputs differ from the whole model's by"),
])
def test_a_plan_that_cannot_hold_is_refused_before_step_1(transformer, tmp_path, plan, says):
    """A pattern that matches nothing, a style for a module it cannot split, and a derived plan the
    forward does not follow: attention that fixes its head count (view(b, t, HEADS, -1)) would
    compute heads of half the size on each of two ranks, and train another model, silently."""
    source = transformer.read_text()
    if plan:
        source = source.replace("def tp_plan(net):", f"def tp_plan(net):\n    return {plan}\n\n\ndef _old(net):")
    else:
        source = source.replace("def tp_plan(net):", "def _no_plan(net):").replace(
            "layer(h).view(b, t, -1, self.head_dim)", "layer(h).view(b, t, HEADS, -1)")
    recipe = tmp_path / "bad.py"
    recipe.write_text(source)
    result = run_cli("train", str(recipe), "-s", "mirrored", "--tp", "2", "--steps", "2", "--json")
    assert result.returncode == 3, result.stderr[-2000:]  # a recipe error
    assert says in result.summary["error"], result.summary["error"]
    steps = [line for line in result.json_lines() if line["type"] == "step"]
    assert not steps, steps  # stopped before the first step


@pytest.mark.parametrize("edit, flags, says", [
    (("        self.o = nn.Linear(WIDTH, WIDTH)\n",
      "        self.o = nn.Linear(WIDTH, WIDTH)\n        self.gain = nn.Parameter(torch.ones(WIDTH))\n"), (),
     "--tp: blocks.0 holds parameters of its own (gain) beside submodules that hold more"),
    (("", ""), ("--loss-parallel",), '--loss-parallel: tp_plan names no "output" layer'),
])
def test_a_model_tensor_parallel_cannot_split_is_refused_before_step_1(transformer, tmp_path, edit, flags, says):
    """A module with a parameter of its own beside children (distrun replicates whole leaf
    modules), and --loss-parallel with no layer marked output (no logits to keep split)."""
    recipe = tmp_path / "model.py"
    recipe.write_text(transformer.read_text().replace(*edit))
    result = run_cli("train", str(recipe), "-s", "mirrored", "--tp", "2", "--steps", "2", "--json", *flags)
    assert result.returncode == 3, result.stderr[-2000:]
    assert says in result.summary["error"], result.summary["error"]
    assert not [line for line in result.json_lines() if line["type"] == "step"]


#: An nn.Sequential of 7 modules whose 60 samples make a short last batch (4 of 8): the pipeline
#: pads it, and the padding must carry no weight.
SEQUENTIAL = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 8, "seed": 0}


def model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def optimizer(params):
    params = list(params)  # two groups: the checkpoints' param groups span the pipeline's stages
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                              {"params": [p for p in params if p.dim() == 1], "lr": 0.02, "weight_decay": 0.0}],
                             lr=0.01)


def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])


def _points(seed, count):
    x = torch.randn(count, 6, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def train_data(ctx):
    return _points(42, 60)


def eval_data(ctx):
    return _points(7, 21)
"""


#: Below the sequential model's first gradient norms (0.38 at step 1): every schedule clips, over
#: the global norm of every stage's gradients, as one device does.
CLIP = "0.2"


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp")
    recipe = folder / "sequential.py"
    recipe.write_text(SEQUENTIAL)
    result, data = _train(recipe, folder / "one", "--epochs", "2", "--clip-grad-norm", CLIP)
    return recipe, result, data


@pytest.mark.parametrize("flags", [
    ("-s", "mirrored", "--pp", "2"),
    ("-s", "mirrored", "--pp", "2", "--pp-schedule", "gpipe"),
    ("-s", "mirrored", "--pp", "2", "--pp-schedule", "interleaved-1f1b"),
    ("-s", "sharded", "--pp", "2", "--replicas", "2", "--pp-schedule", "zero-bubble"),
    ("-s", "mirrored", "--pp", "2", "--pp-schedule", "zbv"),
    ("-s", "mirrored", "--pp", "2", "--pp-schedule", "dualpipe-v", "--microbatches", "4"),
])
def test_every_pipeline_schedule_ends_with_one_devices_parameters(sequential, tmp_path, flags):
    recipe, reference, one = sequential
    result, data = _train(recipe, tmp_path / "ck", *flags, "--epochs", "2", "--clip-grad-norm", CLIP)
    _close(data["model"], one["model"], " ".join(flags))
    assert data["step"] == one["step"] == 16  # 8 batches an epoch, the last one short
    summary = result.summary
    assert summary["final_loss"] == pytest.approx(reference.summary["final_loss"], abs=TOLERANCE)
    assert summary["eval_metrics"]["loss"] == pytest.approx(reference.summary["eval_metrics"]["loss"], abs=TOLERANCE)
    replicas = 2 if "--replicas" in flags else 1
    assert summary["mesh"] == {"dp": replicas, "tp": 1, "pp": 2} and summary["replicas"] == replicas
    said = [line["line"] for line in result.json_lines() if line["type"] == "output" and "pipeline:" in line["line"]]
    stages = 2 if flags[-1] == "2" or "gpipe" in flags else 4  # two stages a rank: interleaved and V-shaped
    assert len(said) == 1 and f"pipeline: {stages} stages over 2 ranks" in said[0], said
    assert "chain from nn.Sequential: stage 0 = 0" in said[0], said


# A chain whose items pass two tensors on (the hidden state and the input, for a skip connection
# across the stage boundary), and a last item that returns two (the loss reads both).
TUPLES = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 8, "seed": 0}


class First(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 16)

    def forward(self, x):
        return torch.tanh(self.inner(x)), x


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.skip = nn.Linear(16, 16), nn.Linear(6, 16)

    def forward(self, h, x):
        return torch.tanh(self.inner(h)) + self.skip(x), x


class Last(nn.Module):
    def __init__(self):
        super().__init__()
        self.out, self.aux = nn.Linear(16, 3), nn.Linear(6, 3)

    def forward(self, h, x):
        return self.out(h), self.aux(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.mix1, self.mix2, self.last = First(), Mix(), Mix(), Last()

    def forward(self, x):
        h, x = self.first(x)
        h, x = self.mix1(h, x)
        h, x = self.mix2(h, x)
        return self.last(h, x)


def model():
    return Net()


def pp_chain(net):
    return [net.first, net.mix1, net.mix2, net.last]


def optimizer(params):
    return torch.optim.AdamW(params, lr=0.01)


def loss(outputs, batch):
    main, aux = outputs
    return nn.functional.cross_entropy(main, batch[1]) + 0.1 * nn.functional.cross_entropy(aux, batch[1])


def _points(seed, n):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def train_data(ctx):
    return _points(42, 60)


def eval_data(ctx):
    return _points(7, 21)

"""


def test_stages_that_pass_several_tensors_on_end_with_one_devices_parameters(tmp_path):
    """A chain item may give a tuple, the next item's arguments (issue 31): a skip connection
    crosses every stage boundary, and the last stage gives the loss two outputs. Under zbv: four
    stages as a V, the backward split in two (the pass-through input has no gradient of its own)."""
    recipe = tmp_path / "tuples.py"
    recipe.write_text(TUPLES)
    reference, one = _train(recipe, tmp_path / "one", "--epochs", "2")
    result, data = _train(recipe, tmp_path / "pp", "-s", "mirrored", "--pp", "2", "--pp-schedule", "zbv", "--epochs", "2")
    _close(data["model"], one["model"], "mirrored --pp 2 --pp-schedule zbv, tuples between stages")
    assert data["step"] == one["step"] == 16  # 8 batches an epoch, the last one short
    assert result.summary["eval_metrics"] == pytest.approx(reference.summary["eval_metrics"], abs=TOLERANCE)
    said = [line["line"] for line in result.json_lines() if line["type"] == "output" and "pipeline:" in line["line"]]
    assert "pipeline: 4 stages over 2 ranks (zbv" in said[0] and "stage 0 = first (" in said[0], said


def test_tp_and_pp_together_and_their_checkpoint_anywhere(transformer, one_device, tmp_path):
    """sharded --pp 2 --tp 2 (4 ranks: two stages of two) matches one-device; its step-4
    checkpoint resumes under sharded with 2 replicas and under one-device, and one-device's
    under --pp 2 --tp 2."""
    _, one, one_dir = one_device
    result, data = _train(transformer, tmp_path / "both", "-s", "sharded", "--pp", "2", "--tp", "2",
                          "--microbatches", "2", *STEPS, "--checkpoint-every", "4", "--tensorboard",
                          str(tmp_path / "board"), "--profile", "2:3")
    _close(data["model"], one["model"], "sharded --pp 2 --tp 2")
    assert result.summary["mesh"] == {"dp": 1, "tp": 2, "pp": 2}
    # The observability flags hold under the 3-D layout too: rank 0's event file, every rank's trace.
    assert list((tmp_path / "board").glob("events.out.tfevents.*")), list((tmp_path / "board").iterdir())
    assert result.summary["profile_traces"] == 4, result.summary  # one trace per rank
    said = [line["line"] for line in result.json_lines() if line["type"] == "output" and "pipeline:" in line["line"]]
    assert said and "the recipe's pp_chain: stage 0 = embed..blocks.0" in said[0], said

    latest_checkpoint(tmp_path / "both").rename(tmp_path / "step8")  # leave step 4 the newest
    shutil.copytree(tmp_path / "both", tmp_path / "whole")
    _, sharded = _train(transformer, tmp_path / "both", "-s", "sharded", "--replicas", "2", *STEPS, "--resume")
    _close(sharded["model"], one["model"], "pp 2 x tp 2 -> sharded x 2")
    _, whole = _train(transformer, tmp_path / "whole", *STEPS, "--resume")
    _close(whole["model"], one["model"], "pp 2 x tp 2 -> one-device")

    shutil.copytree(one_dir, tmp_path / "back")
    latest_checkpoint(tmp_path / "back").unlink()
    _, back = _train(transformer, tmp_path / "back", "-s", "sharded", "--pp", "2", "--tp", "2", "--microbatches",
                     "2", *STEPS, "--resume")
    _close(back["model"], one["model"], "one-device -> pp 2 x tp 2")


@pytest.mark.parametrize("edit, says, code", [
    (("def pp_chain(net):\n    return [net.embed, *net.blocks, net.head]",
      "def pp_chain(net):\n    return [net.embed, net.blocks[0], net.head]"), "pp_chain(model) leaves out blocks.1", 3),
    (("return self.head(x)", "return self.head(x * 2)"), "does not compose to the model's forward", 3),
    (("def pp_chain(net):", "def _no_chain(net):"), "--pp: the model is a Net, not an nn.Sequential", 3),
    (("def pp_chain(net):", "def forward(net, batch):\n    return net(batch[0])\n\n\ndef pp_chain(net):"),
     "a recipe forward(model, batch) cannot be split into them", 3),
])
def test_a_chain_that_cannot_hold_is_refused_before_step_1(transformer, tmp_path, edit, says, code):
    recipe = tmp_path / "bad.py"
    recipe.write_text(transformer.read_text().replace(*edit))
    result = run_cli("train", str(recipe), "-s", "mirrored", "--pp", "2", "--steps", "2", "--json")
    assert result.returncode == code, result.stderr[-2000:]
    assert says in result.summary["error"], result.summary["error"]
    assert not [line for line in result.json_lines() if line["type"] == "step"]


def test_a_pipelined_checkpoint_resumes_pipelined_and_whole(sequential, tmp_path):
    """interleaved-1f1b (two stages a rank, four in all) writes step 8; the same layout resumes
    it to step 16, and so does one-device: both end where the uninterrupted run ended. The
    optimizer's two groups span every stage (their names merged into one sidecar)."""
    recipe, _, one = sequential
    layout = ("-s", "mirrored", "--pp", "2", "--pp-schedule", "interleaved-1f1b", "--clip-grad-norm", CLIP)
    _train(recipe, tmp_path / "pp", *layout, "--steps", "8")
    rows = run_cli("checkpoint", "ls", str(tmp_path / "pp"))  # the table names the layout that wrote it
    assert rows.returncode == 0 and "dp 1 x tp 1 x pp 2" in rows.stdout, rows.stdout
    exported = tmp_path / "export.pt"
    assert run_cli("checkpoint", "export", str(tmp_path / "pp"), "-o", str(exported)).returncode == 0
    assert sorted(torch.load(exported, weights_only=True)) == sorted(one["model"])  # every stage's, whole
    shutil.copytree(tmp_path / "pp", tmp_path / "whole")
    _, resumed = _train(recipe, tmp_path / "pp", *layout, "--epochs", "2", "--resume")
    _close(resumed["model"], one["model"], "interleaved pp 2 -> itself")
    groups = resumed["optimizer"]["param_groups"]
    assert [len(group["params"]) for group in groups] == [4, 4] and groups[1]["lr"] == 0.02
    _, whole = _train(recipe, tmp_path / "whole", "--epochs", "2", "--clip-grad-norm", CLIP, "--resume")
    _close(whole["model"], one["model"], "interleaved pp 2 -> one-device")

