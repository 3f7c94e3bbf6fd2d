"""A fit recipe's evaluations are left out of samples/s and of the step times: a run whose
evaluations take seconds and whose steps take milliseconds reads its steps' rate, not the wall's."""

from __future__ import annotations

from tests.conftest import run_cli
from tests.integration._recipes import _TINY

# The tiny recipe with an evaluation of 0.5 s a rank: 10 rows of 0.05 s each.
_SLOW_EVAL = _TINY.format(samples=4096, loss_body="") + """
defaults = {"global_batch_size": 16}


class _SlowRows(torch.utils.data.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, index):
        time.sleep(0.05)
        return torch.ones(2), torch.ones(1)


def eval_data(ctx):
    return _SlowRows()
"""


def test_seconds_of_evaluation_between_millisecond_steps_leave_samples_per_s_and_step_times(write_recipe):
    """Evaluations after steps 4, 8 and 12 of 13 (0.5 s each, the first one also imports
    torchmetrics): counted, the window from step 1's event to step 13's would be mostly
    evaluation, and the summary's rate would read as the wall's."""
    result = run_cli("train", str(write_recipe(_SLOW_EVAL)), "--json", "-s", "mirrored", "--replicas", "2",
                     "--steps", "13", "--eval-every", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    events = result.json_lines()
    assert sorted({e["step"] for e in events if e["type"] == "eval"}) == [4, 8, 12, 13]
    steps = [e for e in events if e["type"] == "step" and e["rank"] == 0]
    first, last = steps[0], steps[-1]
    assert (first["step"], last["step"]) == (1, 13), [e["step"] for e in steps]
    wall_rate = 16 * 12 / (last["time"] - first["time"])  # the steps after step 1 over the wall, evaluations in it
    assert last["time"] - first["time"] > 1.5  # three evaluations of 0.5 s lie between the two events
    assert result.summary["samples_per_s"] > 3 * wall_rate, (result.summary["samples_per_s"], wall_rate)
    windows = [e["step_ms"] for e in steps if e["step_ms"] is not None]
    assert windows and max(windows) < 100, windows  # counted, a 0.5 s evaluation over 4 steps reads 125+ ms
