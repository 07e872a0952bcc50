"""graph_rewrite.version_book: the copies a relaxed run makes, worked out by hand."""
import pytest

from graph_rewrite.version_book import MODEL, Move, Read, VersionError, Write, plan_moves


def moves(*pairs):
    return [Move(a, b) for a, b in pairs]


def test_two_bw_stage_over_a_run_of_two_batches():
    """Stage 0 of 2, M = 2: batch 0 reads version -1 (slot 0, from the run before), batch 1
    version 0; the run makes versions 1 and 2 and hands version 1 on in slot 0."""
    events = [Read(-1), Read(-1), Read(0), Write(0, 1), Read(0), Write(1, 2)]
    plan = plan_moves(events, 0, {-1: 0}, 2, {1: 0})
    assert plan.before == [
        moves((MODEL, 1), (0, MODEL)),     # keep the latest (0, read later), load -1
        [],
        moves((1, MODEL)),                 # -1 is done: load 0 over it
        [],                                # update 0 -> 1 in place (0 stays in slot 1)
        moves((MODEL, 0), (1, MODEL)),     # keep 1 (the next update's), load 0 again
        moves((0, MODEL)),                 # 0 is done: load 1, update it to 2
    ]
    assert plan.finish == [] and plan.permute == []    # 2 in the variables, 1 in slot 0
    assert plan.slots == 2


def test_pipedream_stage_copies_only_what_a_forward_or_the_next_run_reads():
    """A backward reads no version (its tape kept its forward's): updates run in place; the
    version the next run reads first (1 = latest - 1) is saved before the update that ends
    it."""
    events = [Read(-1), Read(0), Write(0, 1), Write(1, 2)]
    plan = plan_moves(events, 0, {-1: 0}, 2, {1: 0})
    assert plan.before == [moves((MODEL, 1), (0, MODEL)), moves((1, MODEL)), [],
                           moves((MODEL, 0))]
    assert plan.slots == 2


def test_two_pipelines_sharing_variables():
    """AvgPipe's pipelines in one process take turns in the variables; each ends in its slot
    (the variables then get the reference, outside the book)."""
    w = [[("w", p, t) for t in range(2)] for p in range(2)]
    events = [Read(w[0][0]), Read(w[1][0]), Read(w[0][0]), Read(w[1][0]),
              Write(w[0][0], w[0][1]), Write(w[1][0], w[1][1])]
    plan = plan_moves(events, ("z",), {w[0][0]: 0, w[1][0]: 1}, None,
                      {w[0][1]: 0, w[1][1]: 1})
    assert plan.before == [moves((0, MODEL)), moves((1, MODEL)), moves((0, MODEL)),
                           moves((1, MODEL)), moves((0, MODEL)),
                           moves((MODEL, 0), (1, MODEL))]
    assert plan.permute == moves((MODEL, 1))


def test_end_places_versions_where_the_next_run_expects_them():
    events = [Read(0), Write(0, 1), Read(1), Write(1, 2), Read(2), Write(2, 3)]
    plan = plan_moves(events, 0, {-1: 0, -2: 1}, 3, {2: 0, 1: 1})
    # 1 and 2 are saved as their updates overwrite them, into the free slots in order
    assert plan.before[3] == moves((MODEL, 0)) and plan.before[5] == moves((MODEL, 1))
    assert plan.permute == moves((1, 0), (0, 1))        # swapped at once


def test_a_version_no_copy_holds_is_an_error():
    with pytest.raises(VersionError, match="reads version -2, which no copy holds"):
        plan_moves([Read(-2)], 0, {-1: 0}, 0, {})
