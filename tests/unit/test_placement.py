"""Parameter placement for the parameter-server strategy (issue 5 groundwork)."""

import itertools

import pytest

from distrun.strategies.ps.placement import ParamInfo, place


def test_whole_parameters_are_balanced_greedily_and_deterministically():
    params = [ParamInfo("a", (100,)), ParamInfo("b", (60,)), ParamInfo("c", (50,)), ParamInfo("d", (40,)),
              ParamInfo("e", (10,))]
    placement = place(params, 2)
    assert {s.name: s.task for s in placement.shards} == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}
    assert placement.bytes_per_task == (560, 480)
    assert place(params, 2) == placement
    assert [s.name for s in placement.shards] == ["a", "b", "c", "d", "e"]  # the model's own order


def test_the_greedy_rule_is_within_four_thirds_of_the_best_balance():
    sizes = [7, 5, 5, 4, 4, 3, 3, 2, 2, 1]
    params = [ParamInfo(f"p{i}", (size,)) for i, size in enumerate(sizes)]
    tasks = 3
    greedy = max(place(params, tasks).bytes_per_task)
    best = min(max(sum(4 * s for s, t in zip(sizes, assign) if t == k) for k in range(tasks))
               for assign in itertools.product(range(tasks), repeat=len(sizes)) if assign[0] == 0)
    assert greedy <= best * 4 / 3


def test_a_large_embedding_is_split_by_rows_across_every_task():
    params = [ParamInfo("embedding", (10, 8)), ParamInfo("dense", (8, 4))]
    placement = place(params, 3, partition_bytes=200)
    shards = placement.shards_of("embedding")
    assert [(s.task, s.rows) for s in shards] == [(0, (0, 4)), (1, (4, 7)), (2, (7, 10))]
    assert sum(s.nbytes for s in shards) == 10 * 8 * 4
    assert placement.partitioned == ("embedding",)
    assert placement.shards_of("dense")[0].rows is None
    assert sum(placement.bytes_per_task) == 10 * 8 * 4 + 8 * 4 * 4


def test_more_tasks_than_rows_uses_one_row_each():
    placement = place([ParamInfo("e", (2, 1000))], 4, partition_bytes=1)
    assert [(s.task, s.rows) for s in placement.shards] == [(0, (0, 1)), (1, (1, 2))]


@pytest.mark.parametrize("params, tasks, message", [
    ([ParamInfo("a", (1,))], 0, "at least one ps task"),
    ([ParamInfo("a", (1,)), ParamInfo("a", (2,))], 1, "unique"),
])
def test_bad_input_is_refused(params, tasks, message):
    with pytest.raises(ValueError, match=message):
        place(params, tasks)
