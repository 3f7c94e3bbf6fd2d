"""A cluster's links kept for a day (client/_link_cache.py): by what they depend on, never past their age,
and nothing kept where the file is unreadable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distrun.client._link_cache import MAX_AGE_S, cluster_key, keep_links, kept_links
from distrun.config import PLAN_PROBE_VAR, PlanProbeSpec
from distrun.errors import ConfigError

FIGURES = {"nbytes": 8_000_000, "between_hosts": {"bytes_per_s": 1.2e7, "latency_s": 2e-4},
           "within_host": {"bytes_per_s": 3e9, "latency_s": 5e-5}, "gather_bytes_per_s": 1e9,
           "scatter_bytes_per_s": 9e8}
HOSTS = [("h1", "10.0.0.1", 2), ("h2", "10.0.0.2", 2)]


def test_kept_figures_come_back_for_the_same_hosts_within_a_day(tmp_path: Path) -> None:
    key = cluster_key(HOSTS, None, "cpu")
    assert kept_links(str(tmp_path), key) is None  # nothing kept yet
    path = keep_links(str(tmp_path), key, {**FIGURES, "extra": 1}, now=1000.0)
    assert path is not None and path.parent == tmp_path / "links"
    kept = kept_links(str(tmp_path), key, now=1000.0 + MAX_AGE_S - 1)
    assert kept is not None and kept.figures == FIGURES and kept.age_s(now=1060.0) == 60.0
    assert kept_links(str(tmp_path), key, now=1000.0 + MAX_AGE_S) is None  # a day old: timed again


@pytest.mark.parametrize("other", [
    ([("h1", "10.0.0.1", 2), ("h2", "10.0.0.2", 4)], None, "cpu"),    # slots changed
    ([("h1", "10.0.0.1", 2), ("h3", "10.0.0.3", 2)], None, "cpu"),    # a host replaced
    ([("h2", "10.0.0.2", 2), ("h1", "10.0.0.1", 2)], None, "cpu"),    # another rank order
    (HOSTS, "eth1", "cpu"),                                           # another interface
    (HOSTS, None, "cuda"),                                            # another device
])
def test_a_changed_cluster_keeps_its_links_apart(tmp_path: Path, other: tuple) -> None:
    keep_links(str(tmp_path), cluster_key(HOSTS, None, "cpu"), FIGURES)
    assert kept_links(str(tmp_path), cluster_key(*other)) is None


_WRONG = json.dumps({"figures": {**FIGURES, "nbytes": "many"}, "timed_at": 1e12})  # a number gone bad


@pytest.mark.parametrize("text", ["", "{", "[]", '{"figures": {}, "timed_at": 1}', '{"figures": 3, "timed_at": "x"}',
                                  _WRONG])
def test_a_torn_or_foreign_file_reads_as_nothing_kept(tmp_path: Path, text: str) -> None:
    key = cluster_key(HOSTS, None, "cpu")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / f"{key}.json").write_text(text)
    assert kept_links(str(tmp_path), key) is None


def test_an_unwritable_home_keeps_nothing_and_says_so_by_none(tmp_path: Path) -> None:
    (tmp_path / "links").write_text("a file where the folder goes")
    assert keep_links(str(tmp_path), cluster_key(HOSTS, None, "cpu"), FIGURES) is None


def test_the_probe_spec_carries_kept_links_and_refuses_foreign_ones() -> None:
    spec = PlanProbeSpec(hosts=2, ranks_per_host=2, kept_links=FIGURES)
    assert PlanProbeSpec.from_env(spec.to_env()) == spec
    assert PlanProbeSpec.from_env(PlanProbeSpec(hosts=2, ranks_per_host=1).to_env()).kept_links is None
    zero_rate = {**FIGURES, "between_hosts": {"bytes_per_s": 0, "latency_s": 1e-4}}  # the check would divide by it
    for bad in ({**FIGURES, "nbytes": -1}, {**FIGURES, "between_hosts": {"bytes_per_s": "fast"}}, {"nbytes": 1},
                zero_rate):
        with pytest.raises(ConfigError, match="kept_links is not a cluster's kept links"):
            PlanProbeSpec.from_env({PLAN_PROBE_VAR: json.dumps({"hosts": 2, "ranks_per_host": 1, "kept_links": bad})})
