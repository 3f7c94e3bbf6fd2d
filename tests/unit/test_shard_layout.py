"""`--shard-within auto`: HSDP on two or more hosts when the model state fits a host's ranks."""

import pytest

from distrun.errors import ConfigError
from distrun.strategies.sharding.mesh import BYTES_PER_PARAMETER, choose_layout

GIB = 2.0**30


def test_one_host_or_all_never_takes_hsdp():
    assert not choose_layout("auto", hosts=1, world=8, parameters=10, rank_memory_bytes=GIB).hsdp
    assert not choose_layout("all", hosts=4, world=8, parameters=10, rank_memory_bytes=GIB).hsdp
    assert choose_layout("host", hosts=4, world=8, parameters=10**12, rank_memory_bytes=GIB).hsdp  # asked for


def test_auto_takes_hsdp_while_a_hosts_share_fits_half_a_ranks_memory():
    """8 GPUs of 80 GiB on each of 4 hosts: a host's 8 ranks hold 16 B per parameter between them."""
    memory = 80 * GIB
    fits = int(0.5 * memory * 8 / BYTES_PER_PARAMETER)  # the most parameters that still fit
    chosen = choose_layout("auto", hosts=4, world=32, parameters=fits, rank_memory_bytes=memory)
    assert chosen.hsdp and "fits in half of 80.0 GiB" in chosen.why
    too_big = choose_layout("auto", hosts=4, world=32, parameters=fits + 10**6, rank_memory_bytes=memory)
    assert not too_big.hsdp and "does not fit" in too_big.why


def test_ranks_that_do_not_split_over_the_hosts():
    assert "do not split evenly" in choose_layout("auto", hosts=2, world=5, parameters=1, rank_memory_bytes=GIB).why
    with pytest.raises(ConfigError, match="--shard-within host: 5 ranks do not split evenly over 2 hosts"):
        choose_layout("host", hosts=2, world=5, parameters=1, rank_memory_bytes=GIB)
