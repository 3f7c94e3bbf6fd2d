"""What a worker server may name as a job's checkpoint: the client writes and replaces only
``ckpt-<step>`` files and folders inside its results folder, whatever the server answers."""

from types import SimpleNamespace

import pytest

from distrun.client._results import checkpoint_parts
from distrun.errors import HostError

LINK = SimpleNamespace(label="h1")


def test_a_file_a_folder_and_nothing():
    assert checkpoint_parts(LINK, {"checkpoint": None}) is None
    assert checkpoint_parts(LINK, {"checkpoint": "/w/ck/ckpt-000000014.pt"}) == (
        "/w/ck/ckpt-000000014.pt", "ckpt-000000014.pt", None)
    parts = [".metadata", "__0_0.distcp", "distrun.json"]
    assert checkpoint_parts(LINK, {"checkpoint": "/w/ck/ckpt-000000014", "checkpoint_files": parts}) == (
        "/w/ck/ckpt-000000014", "ckpt-000000014", parts)


@pytest.mark.parametrize("answer", [
    {"checkpoint": "/x/.."},  # its name is "..": the client would replace the folder above its own
    {"checkpoint": "/"},  # no name: the results folder itself
    {"checkpoint": "/w/summary.json"},
    {"checkpoint": "/w/ck/ckpt-1", "checkpoint_files": ["../../.bashrc"]},
    {"checkpoint": "/w/ck/ckpt-1", "checkpoint_files": [".."]},
    {"checkpoint": "/w/ck/ckpt-1", "checkpoint_files": "__0_0.distcp"},
])
def test_any_other_name_is_a_host_error(answer):
    with pytest.raises(HostError, match="h1: the server named a checkpoint file distrun does not write"):
        checkpoint_parts(LINK, answer)
