"""TimestampRange, TimestampRangeTracker and ManualWatermarkEstimator contracts."""

from __future__ import annotations

import itertools
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcflow.errors import TrackerError
from cdcflow.model import MAX_NS
from cdcflow.restriction import ManualWatermarkEstimator, TimestampRange, TimestampRangeTracker


def test_range_is_validated_and_half_open() -> None:
    r = TimestampRange(10, 20)
    assert 10 in r and 19 in r and 20 not in r and 9 not in r
    assert r.size == 10
    assert TimestampRange(5, 5).is_empty()
    with pytest.raises(ValueError, match="start <= end"):
        TimestampRange(21, 20)


def test_claims_inside_and_stop_at_end() -> None:
    t = TimestampRangeTracker(TimestampRange(100, 200))
    assert t.try_claim(100)
    assert t.try_claim(150)
    assert t.try_claim(150)  # many records share one commit timestamp
    assert t.try_claim(199)
    assert not t.try_claim(200)
    t.check_done()
    assert t.last_claimed == 199


def test_claim_before_start_or_backwards_raises() -> None:
    t = TimestampRangeTracker(TimestampRange(100, 200))
    with pytest.raises(TrackerError, match="before the range start"):
        t.try_claim(99)
    assert t.try_claim(150)
    with pytest.raises(TrackerError, match="backwards"):
        t.try_claim(149)
    assert not t.try_claim(250)
    with pytest.raises(TrackerError, match="backwards"):
        t.try_claim(180)  # the caller was told to stop


def test_checkpoint_after_claims() -> None:
    t = TimestampRangeTracker(TimestampRange(100, 200))
    assert t.try_claim(120)
    assert t.try_split(0) == (TimestampRange(100, 121), TimestampRange(121, 200))
    assert t.current_restriction() == TimestampRange(100, 121)
    assert t.try_claim(120)  # the same position is still inside the primary
    assert not t.try_claim(121)
    t.check_done()


def test_checkpoint_before_any_claim_hands_back_everything() -> None:
    t = TimestampRangeTracker(TimestampRange(100, 200))
    assert t.try_split(0) == (TimestampRange(100, 100), TimestampRange(100, 200))
    assert not t.try_claim(100)
    t.check_done()


def test_no_split_when_done() -> None:
    t = TimestampRangeTracker(TimestampRange(100, 200))
    assert t.try_claim(199)
    assert t.try_split(0) is None
    t2 = TimestampRangeTracker(TimestampRange(100, 200))
    assert not t2.try_claim(200)
    assert t2.try_split(0) is None
    assert TimestampRangeTracker(TimestampRange(7, 7)).try_split(0) is None


def test_fractional_split_keeps_share_of_rest() -> None:
    t = TimestampRangeTracker(TimestampRange(0, 100))
    assert t.try_claim(9)
    assert t.try_split(0.5) == (TimestampRange(0, 55), TimestampRange(55, 100))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        t.try_split(1.0)


def test_check_done_names_the_fix() -> None:
    t = TimestampRangeTracker(TimestampRange(100, 200))
    assert t.try_claim(150)
    with pytest.raises(TrackerError, match=r"try_claim\(200\)"):
        t.check_done()
    assert not t.try_claim(200)
    t.check_done()


def test_bounded_and_pickle() -> None:
    assert TimestampRangeTracker(TimestampRange(0, 10)).is_bounded()
    t = TimestampRangeTracker(TimestampRange(0, MAX_NS))
    assert not t.is_bounded()
    assert t.try_claim(5)
    copy = pickle.loads(pickle.dumps(t))
    assert copy.last_claimed == 5
    assert copy.try_claim(6)
    with pytest.raises(TrackerError, match="backwards"):
        copy.try_claim(4)  # the copy keeps the last attempt


@given(
    start=st.integers(0, 10**6),
    length=st.integers(0, 10**4),
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 50), max_size=6), st.floats(0, 0.99)), max_size=20
    ),
)
def test_repeated_checkpoints_tile_the_range(
    start: int, length: int, steps: list[tuple[list[int], float]]
) -> None:
    """Slices produced by claim-then-checkpoint rounds never gap or overlap and cover all."""
    end = start + length
    pieces: list[TimestampRange] = []
    rest: TimestampRange | None = TimestampRange(start, end)
    for gaps, fraction in steps:
        if rest is None:
            break
        tracker = TimestampRangeTracker(rest)
        pos = rest.start
        for gap in sorted(gaps):
            pos = rest.start + gap
            if not tracker.try_claim(pos):
                break
        split = tracker.try_split(fraction)
        if split is None:
            tracker.check_done()  # nothing left to split off means done
            pieces.append(tracker.current_restriction())
            rest = None
        else:
            primary, residual = split
            assert primary.end == residual.start
            if tracker.last_claimed is not None and fraction == 0:
                assert primary.end == tracker.last_claimed + 1
            pieces.append(primary)
            rest = residual
    if rest is not None:
        pieces.append(rest)
    assert pieces[0].start == start
    assert pieces[-1].end == end
    for a, b in itertools.pairwise(pieces):
        assert a.end == b.start
    assert sum(p.size for p in pieces) == length


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=30))
def test_claims_are_accepted_iff_non_decreasing(positions: list[int]) -> None:
    t = TimestampRangeTracker(TimestampRange(0, 500))
    highest = -1
    for p in positions:
        if p < highest:
            with pytest.raises(TrackerError):
                t.try_claim(p)
            return
        claimed = t.try_claim(p)
        assert claimed == (p < 500)
        highest = p
        if not claimed:
            return


def test_watermark_estimator_never_regresses() -> None:
    w = ManualWatermarkEstimator(10)
    assert w.current_watermark() == 10
    w.set_watermark(10)
    w.set_watermark(15)
    with pytest.raises(TrackerError, match="backwards"):
        w.set_watermark(14)
    assert pickle.loads(pickle.dumps(w)).current_watermark() == 15
