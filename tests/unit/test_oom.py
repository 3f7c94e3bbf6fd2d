"""Finding a rank's memory cgroup and reading its OOM kill count, limit, use and peak
(planner/memory.py, which launch/_oom and --strategy auto's budgets read).

The kernel's own OOM killer on a v1 cgroup is in tests/integration/test_faults.py; v2's files
are laid out here in a folder, as the kernel names them."""

from pathlib import Path

from distrun.planner.memory import MemoryCgroup, locate, rank_budget_bytes

HYBRID_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def _v2_tree(root: Path) -> Path:
    """job (memory.max 2 GiB) / rank1 (memory.max "max", 3 OOM kills, peak 1.9 GiB)."""
    job = root / "job"
    rank = job / "rank1"
    rank.mkdir(parents=True)
    (root / "memory.max").write_text("max\n")  # not the root: a delegated subtree's top
    (job / "memory.max").write_text(f"{2 * 2**30}\n")
    (rank / "memory.max").write_text("max\n")
    (rank / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 3\noom_kill 3\noom_group_kill 0\n")
    (rank / "memory.peak").write_text(f"{int(1.9 * 2**30)}\n")
    return rank


def test_v2_cgroup_is_found_under_its_mount_with_the_tightest_ancestor_limit(tmp_path):
    _v2_tree(tmp_path)
    mounts = f"29 23 0:26 / {tmp_path} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    found = locate("0::/job/rank1\n", mounts)
    assert found is not None and found.version == 2 and found.folder == tmp_path / "job" / "rank1"
    assert found.oom_kills() == 3
    assert found.limit_bytes() == 2 * 2**30  # the job's limit binds the rank
    assert found.peak_bytes() == int(1.9 * 2**30)


def test_a_mount_of_a_subtree_maps_the_cgroup_name_below_its_root(tmp_path):
    _v2_tree(tmp_path)
    mounts = f"29 23 0:26 /job {tmp_path / 'job'} rw - cgroup2 cgroup2 rw\n"  # a container sees /job as its root
    found = locate("0::/job/rank1\n", mounts)
    assert found is not None and found.folder == tmp_path / "job" / "rank1"
    assert locate("0::/elsewhere/rank1\n", mounts) is None  # outside what this mount shows


def test_a_hybrid_host_reads_the_v1_memory_controller(tmp_path):
    v1, v2 = tmp_path / "memory", tmp_path / "unified"
    (v1 / "job").mkdir(parents=True)
    (v2 / "job").mkdir(parents=True)
    (v1 / "job" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (v1 / "job" / "memory.stat").write_text(f"cache 0\nhierarchical_memory_limit {1536 * 2**20}\n")
    (v1 / "job" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")  # its own: none; its parent's binds
    mounts = (f"35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory\n"
              f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw\n")
    found = locate("9:pids:/\n4:memory:/job\n0::/job\n", mounts)
    assert found is not None and found.version == 1 and found.folder == v1 / "job"
    assert found.oom_kills() == 2 and found.limit_bytes() == 1536 * 2**20
    (v1 / "job" / "memory.stat").write_text(f"hierarchical_memory_limit {2**63 - 4096}\n")
    assert found.limit_bytes() is None  # v1's "no limit"
    assert locate("0::/\n", "") is None  # no cgroup file system mounted: nothing to tell


def test_a_ranks_budget_is_its_share_of_the_cgroups_room_where_that_is_tighter(tmp_path):
    """Two ranks of a host, each holding 300 MB: MemAvailable of 10 GB gives each 5.3 GB; a v2
    cgroup of 2 GiB using 1 GiB now gives each half its 1 GiB of room plus what it holds."""
    mb = 2**20
    _v2_tree(tmp_path / "cg")
    job = tmp_path / "cg" / "job"
    (job / "memory.current").write_text(f"{1024 * mb}\n")
    group = MemoryCgroup(job, "/job", 2)
    budget, source = rank_budget_bytes(2, 300 * mb, group, 10 * 2**30)
    assert budget == 512 * mb + 300 * mb and source.startswith("memory cgroup /job's limit less its use")
    assert rank_budget_bytes(2, 300 * mb, None, 10 * 2**30) == (5 * 2**30 + 300 * mb, "MemAvailable, shared by 2 rank(s)")
    # A cgroup with room to spare: the host's available memory is the tighter.
    (job / "memory.current").write_text("0\n")
    assert rank_budget_bytes(2, 300 * mb, group, 1 * 2**30)[1] == "MemAvailable, shared by 2 rank(s)"
