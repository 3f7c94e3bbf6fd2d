"""Recipe sources used by the integration tests."""

# `-- --samples N` sets the dataset size. At global batch 16, 97 samples make a last
# batch of ONE sample (one replica's share is empty: padding of weight 0); 99 make a
# last batch of 3, split 2 + 1 (only loss weighting keeps that step exact).
EQUIV = """
import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 16}


def model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def optimizer(params):
    return torch.optim.Adam(params, lr=0.01)


def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])


SAMPLES = int(sys.argv[sys.argv.index("--samples") + 1]) if "--samples" in sys.argv else 97


def train_data(ctx):
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(SAMPLES, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def eval_data(ctx):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(41, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def metrics():
    from torchmetrics.classification import MulticlassAccuracy
    return {"accuracy": MulticlassAccuracy(num_classes=3, average="micro")}
"""

_TINY = """
import os
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset

def model():
    return nn.Linear(2, 1)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def loss(outputs, batch):
{loss_body}
    return nn.functional.mse_loss(outputs, batch[1])

def train_data(ctx):
    return TensorDataset(torch.randn({samples}, 2), torch.randn({samples}, 1))
"""

# Rank 1 raises in its third step.
RAISES_IN_RANK_1 = _TINY.format(samples=256, loss_body="""\
    step = int(os.environ.setdefault("STEPS_SEEN", "0")) + 1
    os.environ["STEPS_SEEN"] = str(step)
    if step == 3 and int(os.environ["RANK"]) == 1:
        raise ValueError("boom at step 3")""")

# Rank 0 raises in its third step (the job's only rank when it runs one replica).
RAISES_IN_RANK_0 = _TINY.format(samples=256, loss_body="""\
    step = int(os.environ.setdefault("STEPS_SEEN", "0")) + 1
    os.environ["STEPS_SEEN"] = str(step)
    if step == 3 and int(os.environ.get("RANK", "0")) == 0:
        raise ValueError("boom at step 3")""")

# Every rank raises a backend error of torch's own DistError family from its third step on, every
# peer alive: what a recurring gloo failure (a size mismatch) looks like to the fit loop.
DIST_ERROR_EVERY_STEP = _TINY.format(samples=256, loss_body="""\
    step = int(os.environ.setdefault("STEPS_SEEN", "0")) + 1
    os.environ["STEPS_SEEN"] = str(step)
    if step >= 3:
        import torch.distributed as dist
        raise dist.DistBackendError(f"simulated size mismatch at step {step}")""")

# Slow enough to be interrupted mid-training.
SLOW = _TINY.format(samples=4096, loss_body="    time.sleep(0.05)")

# Faults for the recipes below, from their arguments: `-- --die-rank R --die-at N --once FILE`
# makes rank R SIGKILL itself at its Nth step, once (the file marks it done, so a restarted
# rank lives; without `--once`, every start of it dies there); `--hang-rank R` makes it hang there instead; `--sleep-s S` slows every step
# of rank `--slow-rank` (default: every rank).
_FAULTS = """
import os
import signal
import sys
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset


def _arg(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


DIE_RANK, HANG_RANK, DIE_AT, ONCE = _arg("--die-rank", -1), _arg("--hang-rank", -1), _arg("--die-at", 0), _arg("--once", "")
SLEEP_S, SLOW_RANK = _arg("--sleep-s", 0.0), _arg("--slow-rank", -1)
RANK = int(os.environ.get("RANK", "0"))
if _arg("--pid-dir", ""):  # where a test finds each rank's process (a rank forked warm shows its server's cmdline)
    with open(os.path.join(_arg("--pid-dir", ""), str(RANK)), "w") as _fh:
        _fh.write(str(os.getpid()))
calls = 0


def _step_faults():
    global calls
    calls += 1
    if RANK in (DIE_RANK, HANG_RANK) and calls == DIE_AT and not (ONCE and os.path.exists(ONCE)):
        if ONCE:
            open(ONCE, "w").close()
        if RANK == DIE_RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    if SLEEP_S and SLOW_RANK in (-1, RANK):
        time.sleep(SLEEP_S)
"""

# parameter-server tests (faults above).
PS_RECIPE = _FAULTS + """
defaults = {"global_batch_size": 32}


def model():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05)


def loss(outputs, batch):
    _step_faults()
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 8, generator=gen)
    w = torch.linspace(-1, 1, 8).unsqueeze(1)
    return TensorDataset(x, x @ w + 0.5)
"""

# fp16 tests: `-- --overflow-at N --overflow-rank R` multiplies rank R's loss at its Nth
# step by 1e30: finite in fp32, inf once its gradient is cast to fp16 in backward.
FP16_OVERFLOW = EQUIV + """

_ARGS = sys.argv[1:]
OVERFLOW_AT = int(_ARGS[_ARGS.index("--overflow-at") + 1]) if "--overflow-at" in _ARGS else 0
OVERFLOW_RANK = int(_ARGS[_ARGS.index("--overflow-rank") + 1]) if "--overflow-rank" in _ARGS else 0
_steps = [0]


def loss(outputs, batch):
    import os
    _steps[0] += 1
    value = nn.functional.cross_entropy(outputs, batch[1])
    if _steps[0] == OVERFLOW_AT and int(os.environ["RANK"]) == OVERFLOW_RANK:
        return value * 1e30
    return value
"""

# --elastic tests (faults above): EQUIV's model and data with Adam (its state must be healed
# too), a global batch of 18 (6 per replica over 3, 9 over 2).
ELASTIC = _FAULTS + """
defaults = {"global_batch_size": 18}

# `--die-in-heal R`: rank R (its first start) SIGKILLs itself in its first heal, inside a recovery.
if RANK == _arg("--die-in-heal", -1) and os.environ.get("DISTRUN_INCARNATION", "0") == "0":
    import distrun.strategies.elastic.heal as _heal_module

    def _die_in_heal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    _heal_module.broadcast_tensors = _die_in_heal

# `--die-describing R`: rank R (its first start), the source of its first heal, SIGKILLs itself
# before it writes the manifest the other members wait for.
if RANK == _arg("--die-describing", -1) and os.environ.get("DISTRUN_INCARNATION", "0") == "0":
    import distrun.strategies.elastic.heal as _heal_module

    def _die_describing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    _heal_module._describe = _die_describing

# `--die-in-global R`: rank R (its first start) SIGKILLs itself in diloco's heal, in its second
# collective (the global weights), after the first (the state) has ended everywhere.
if RANK == _arg("--die-in-global", -1) and os.environ.get("DISTRUN_INCARNATION", "0") == "0":
    import distrun.strategies.local_sgd.outer as _outer_module

    def _die_in_global(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    _outer_module.broadcast_tensors = _die_in_global

# `--die-forming R`: rank R (its first start) SIGKILLs itself as the second group formed after the
# recipe loads does (the first group forms before): after the one that goes on without a lost
# member, the one that takes in that member's next start.
if RANK == _arg("--die-forming", -1) and os.environ.get("DISTRUN_INCARNATION", "0") == "0":
    import torch.distributed as _dist

    _formed = [0]
    _init_process_group = _dist.init_process_group

    def _die_forming(*args, **kwargs):
        _formed[0] += 1
        if _formed[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return _init_process_group(*args, **kwargs)

    _dist.init_process_group = _die_forming

# `--die-joining R`: rank R's second start (a joiner) SIGKILLs itself as its first group forms,
# after it arrived in the round the others wait in.
if RANK == _arg("--die-joining", -1) and os.environ.get("DISTRUN_INCARNATION", "0") == "1":
    import torch.distributed as _dist

    def _die_joining(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    _dist.init_process_group = _die_joining


# `--cut-store R --cut-store-at N`: rank R (its first start) shuts down its own connections to the
# job's store at its Nth step, as a partition longer than TCP waits leaves them: torch's store client
# never reconnects, so the rank is cut off from the job.
_CUT_RANK, _CUT_AT = _arg("--cut-store", -1), _arg("--cut-store-at", 0)


def _cut_store():
    import socket

    if RANK != _CUT_RANK or calls != _CUT_AT or os.environ.get("DISTRUN_INCARNATION", "0") != "0":
        return
    port = int(os.environ["MASTER_PORT"])
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername()[1] == port:
                sock.shutdown(socket.SHUT_RDWR)
        except (OSError, IndexError, TypeError):
            pass
        finally:
            sock.close()  # the duplicate only: the shut connection stays the store client's


def model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def optimizer(params):
    return torch.optim.Adam(params, lr=0.01)


def loss(outputs, batch):
    _step_faults()
    _cut_store()
    return nn.functional.cross_entropy(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(180, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
"""


# `-- --slow-rank R`: rank R sleeps 120 ms in each loss, every other rank 30 ms (-1: none is slow).
SLOW_RANK_RECIPE = """
import os
import sys
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 48}
RANK = int(os.environ.get("RANK", "0"))
SLOW = int(sys.argv[sys.argv.index("--slow-rank") + 1]) if "--slow-rank" in sys.argv else -1


def model():
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)


def loss(outputs, batch):
    time.sleep(0.12 if RANK == SLOW else 0.03)
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(4096, 16, generator=gen), torch.randn(4096, 1, generator=gen))
"""
