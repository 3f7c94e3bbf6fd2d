"""--precision and --compile: the step settings mean the same under every strategy."""

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV, FP16_OVERFLOW
from tests.integration.test_equivalence import train

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]


# 96 samples at global batch 16: six full batches an epoch, so no step is weighted and
# every step has the same shapes (no recompilation under --compile).
FULL_BATCHES = ("--", "--samples", "96")
STEPS, LR = 12, 0.01  # two epochs of EQUIV's Adam
#: Unit roundoff of each precision's significand (8 and 11 bits).
EPS = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def checkpoint(ckpt):
    return load_checkpoint(latest_checkpoint(ckpt))


def max_diff(a, b):
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    """EQUIV's two epochs in fp32 on one device: what reduced precision must differ from."""
    root = tmp_path_factory.mktemp("fp32")
    (root / "recipe.py").write_text(EQUIV)
    train(root / "recipe.py", root / "ck", "one-device", "--epochs", "2", *FULL_BATCHES)
    return checkpoint(root / "ck")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_gives_one_device_parameters_under_mirrored(write_recipe, tmp_path, fp32, precision):
    """Tolerance: each replica rounds its own half-batch, so the two layouts differ by
    rounding alone. Adam moves a parameter by about lr per step whatever the gradient's
    size, and a rounding difference changes that move by at most the precision's relative
    roundoff; after STEPS steps they can drift apart by at most STEPS * LR * EPS. The
    precision itself must matter more than the layout does, or autocast did nothing."""
    recipe = write_recipe(EQUIV)
    runs = {}
    for strategy in ("one-device", "mirrored", "sharded"):  # sharded: FSDP's MixedPrecisionPolicy, not autocast
        result = train(recipe, tmp_path / strategy, strategy, "--precision", precision, "--epochs", "2", *FULL_BATCHES)
        assert result.summary["precision"] == precision
        runs[strategy] = checkpoint(tmp_path / strategy)
    for strategy in ("mirrored", "sharded"):
        assert runs[strategy]["step"] == STEPS
        layout = max_diff(runs[strategy], runs["one-device"])
        assert layout <= STEPS * LR * EPS[precision], strategy
        assert max_diff(runs["one-device"], fp32) > layout, strategy
        if precision == "fp16":
            assert runs[strategy]["scaler"] == runs["one-device"]["scaler"]
            assert runs[strategy]["scaler"]["_growth_tracker"] == STEPS  # no overflow in this run


def skipped_steps(result):
    """{rank: [step, ...]} of the fp16 skips each rank reported."""
    skips = {}
    for line in result.json_lines():
        if line["type"] == "log" and "fp16_skipped_step" in line["scalars"]:
            skips.setdefault(line["rank"], []).append(line["step"])
    return skips


@pytest.mark.parametrize("strategy", ["central-storage", "mirrored", "sharded"])
def test_an_fp16_overflow_on_one_replica_skips_the_step_on_every_replica(write_recipe, tmp_path, strategy):
    """central-storage keeps each replica's gradients apart until its optimizer step, so
    only the all-reduced verdict makes rank 0 skip rank 1's overflow; without it rank 0
    would step alone and the two would disagree on the collective that follows."""
    recipe = write_recipe(FP16_OVERFLOW)
    result = train(recipe, tmp_path / "ckpt", strategy, "--precision", "fp16", "--steps", "6",
                   "--", "--samples", "96", "--overflow-at", "3", "--overflow-rank", "1")
    assert skipped_steps(result) == {0: [3], 1: [3]}
    scaler = checkpoint(tmp_path / "ckpt")["scaler"]
    assert scaler["scale"] == 2.0**15 and scaler["_growth_tracker"] == 3  # halved once, then 3 clean steps
    clean = train(recipe, tmp_path / "clean", strategy, "--precision", "fp16", "--steps", "6", *FULL_BATCHES)
    assert skipped_steps(clean) == {}
    assert max_diff(checkpoint(tmp_path / "ckpt"), checkpoint(tmp_path / "clean")) > 0  # a step was really skipped


def test_fp16_resume_restores_the_loss_scaler(write_recipe, tmp_path):
    recipe = write_recipe(FP16_OVERFLOW)
    overflow = ("--", "--samples", "96", "--overflow-at", "3", "--overflow-rank", "0")
    train(recipe, tmp_path / "straight", "mirrored", "--precision", "fp16", "--steps", "6", *overflow)
    train(recipe, tmp_path / "resumed", "mirrored", "--precision", "fp16", "--steps", "4", *overflow)
    assert checkpoint(tmp_path / "resumed")["scaler"]["scale"] == 2.0**15
    # The resumed process counts its steps from 1 again: no overflow is injected after the resume.
    train(recipe, tmp_path / "resumed", "mirrored", "--precision", "fp16", "--steps", "6", "--resume", *FULL_BATCHES)
    straight, resumed = checkpoint(tmp_path / "straight"), checkpoint(tmp_path / "resumed")
    assert resumed["step"] == 6
    assert resumed["scaler"] == straight["scaler"]  # 2**15 and 3 clean steps: not a fresh 2**16
    assert max_diff(resumed, straight) == 0.0


@pytest.mark.parametrize("strategy, graphs", [("mirrored", 1), ("sharded", 2)])
def test_compile_matches_eager_one_device(write_recipe, tmp_path, strategy, graphs):
    """mirrored compiles the DDP-wrapped model; sharded compiles each of EQUIV's two Linear blocks
    before sharding it (one graph each: nn.Linear's forward is torch's own, compiled all the same)."""
    recipe = write_recipe(EQUIV)
    train(recipe, tmp_path / "eager", "one-device", "--epochs", "2", *FULL_BATCHES)
    result = train(recipe, tmp_path / "compiled", strategy, "--compile", "--epochs", "2", *FULL_BATCHES)
    compiled = [line for line in result.json_lines() if line["type"] == "compile" and line["rank"] == 0]
    assert compiled and compiled[-1]["graphs"] >= graphs  # it really compiled (not an eager fallback)
    summary = result.summary["compile"]
    assert summary["mode"] == "default" and summary["graphs"] >= 1 and summary["graph_breaks"] == 0
    assert summary["compile_s"] > 0
    eager, ours = checkpoint(tmp_path / "eager"), checkpoint(tmp_path / "compiled")
    assert set(ours["model"]) == set(eager["model"])  # plain keys: no _orig_mod., module. prefixes
    for key, tensor in eager["model"].items():
        torch.testing.assert_close(ours["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_graph_breaks_are_reported_with_their_reason(write_recipe, tmp_path):
    recipe = write_recipe(EQUIV.replace(
        "def model():\n    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))",
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))\n"
        "    def forward(self, x):\n"
        "        h = self.body(x)\n"
        "        if h.sum().item() > 1e9:  # data-dependent Python: a graph break\n"
        "            h = h * 2\n"
        "        return h\n\n\n"
        "def model():\n    return Net()"))
    result = train(recipe, tmp_path / "ckpt", "one-device", "--compile", "--steps", "3", *FULL_BATCHES)
    summary = result.summary["compile"]
    assert summary["graph_breaks"] >= 1
    events = [line for line in result.json_lines() if line["type"] == "compile"]
    assert events and any("item" in reason.lower() or "scalar" in reason.lower() for reason in events[-1]["reasons"])


def test_fp16_parameter_server_unscales_embedding_rows_and_dense_gradients(tmp_path):
    """One asynchronous worker applies its batches in order, as one-device does, so both must
    agree under fp16 too; an embedding row's gradient left scaled (it is not in param.grad)
    would move that row 65536 times too far."""
    embedding = str(REPO / "recipes" / "embedding.py")
    for strategy in ("one-device", "ps"):
        extra = ("--replicas", "1", "--ps-partition-mb", "0.1", "--ps-tasks", "2") if strategy == "ps" else ()
        result = train(embedding, tmp_path / strategy, strategy, "--precision", "fp16", "--steps", "20", *extra)
        assert result.summary["precision"] == "fp16"
    ps, one = checkpoint(tmp_path / "ps"), checkpoint(tmp_path / "one-device")
    assert ps["step"] == one["step"] == 20
    assert max_diff(ps, one) <= 20 * LR * EPS["fp16"]
    assert ps["scaler"]["scale"] == one["scaler"]["scale"] == 2.0**16


def test_an_fp16_overflow_skips_one_parameter_server_workers_push(write_recipe, tmp_path):
    recipe = write_recipe(FP16_OVERFLOW)
    result = train(recipe, tmp_path / "ckpt", "ps", "--precision", "fp16", "--replicas", "1", "--steps", "6",
                   "--", "--samples", "96", "--overflow-at", "3", "--overflow-rank", "0")
    assert skipped_steps(result) == {0: [3]}  # logged at the update it did not make
    saved = checkpoint(tmp_path / "ckpt")
    assert saved["step"] == 6 and saved["scaler"]["scale"] == 2.0**15


def test_fp16_with_ps_sync_is_refused(write_recipe):
    result = run_cli("train", str(write_recipe(EQUIV)), "-s", "ps", "--ps-sync", "--precision", "fp16")
    assert result.returncode == 2 and "--precision fp16 with --ps-sync" in result.stderr, result.stderr
