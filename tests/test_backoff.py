"""The one retry policy: delay bounds, attempt bound, deadline, predicate, callbacks.

Every test runs on a fake clock whose ``sleep`` only advances it, so none takes real time.
"""

from __future__ import annotations

import math
import pickle
import random
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcflow.backoff import RetryPolicy


class FakeTime:
    """A monotonic clock that moves only when slept on or told to."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.now += seconds


def policy(fake: FakeTime, **kwargs: float | None) -> RetryPolicy:
    return RetryPolicy(
        sleep=fake.sleep, clock=fake.clock, rng=random.Random(3), **kwargs  # type: ignore[arg-type]
    )


class Flaky:
    """Fails with the given errors in turn, then returns ``value``; records each call."""

    def __init__(self, *errors: BaseException, value: str = "ok",
                 took: float = 0.0, fake: FakeTime | None = None) -> None:
        self.errors = list(errors)
        self.value = value
        self.took = took
        self.fake = fake
        self.starts: list[float] = []

    def __call__(self) -> str:
        if self.fake is not None:
            self.starts.append(self.fake.now)
            self.fake.now += self.took
        else:
            self.starts.append(0.0)
        if self.errors:
            raise self.errors.pop(0)
        return self.value


def always(_: BaseException) -> bool:
    return True


def notes(exc: BaseException) -> list[str]:
    return list(getattr(exc, "__notes__", []))


# --- delays ------------------------------------------------------------------------------

_SECONDS = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)


@given(
    initial=_SECONDS, maximum=_SECONDS,
    multiplier=st.floats(1, 1e3, allow_nan=False, allow_infinity=False),
    seed=st.integers(0, 2**32), retries=st.integers(1, 3000),
)
def test_delays_stay_within_caps_that_grow_to_the_maximum(
    initial: float, maximum: float, multiplier: float, seed: int, retries: int
) -> None:
    p = RetryPolicy(initial=initial, maximum=maximum, multiplier=multiplier,
                    rng=random.Random(seed))
    numbers = sorted({1, 2, 3, retries, retries + 1, 10 * retries})
    caps = [p.cap(n) for n in numbers]
    assert caps == sorted(caps)  # never decreasing
    assert all(0 <= c <= maximum for c in caps)
    assert p.cap(1) == min(initial, maximum)
    # Each cap is the one before times the multiplier, up to the maximum.
    for n in (1, 2, retries):
        grown = min(maximum, p.cap(n) * multiplier)
        assert math.isclose(p.cap(n + 1), grown, rel_tol=1e-9, abs_tol=1e-300) or (
            p.cap(n + 1) == maximum
        )
    for n, cap in zip(numbers, caps, strict=True):
        for _ in range(5):
            assert 0 <= p.delay(n) <= cap


def test_full_jitter_spans_the_whole_window() -> None:
    p = RetryPolicy(initial=1.0, maximum=4.0, rng=random.Random(11))
    delays = [p.delay(3) for _ in range(2000)]
    assert min(delays) < 0.2 and max(delays) > 3.8  # [0, 4], not [2, 4] or a fixed value


def test_backoff_sleeps_the_delay_it_returns() -> None:
    fake = FakeTime()
    p = policy(fake, initial=1.0, maximum=8.0)
    waited = p.backoff(4)
    assert fake.slept == [waited] and 0 <= waited <= 8.0


def test_a_zero_initial_delay_never_waits() -> None:
    p = RetryPolicy(initial=0.0)
    assert [p.delay(n) for n in (1, 5, 50)] == [0.0, 0.0, 0.0]


def test_retries_are_numbered_from_one() -> None:
    with pytest.raises(ValueError, match="numbered from 1"):
        RetryPolicy().delay(0)


# --- call: the attempt bound ---------------------------------------------------------------


def test_call_returns_the_first_success_and_reports_each_retry() -> None:
    fake = FakeTime()
    errors = [TimeoutError("one"), ConnectionError("two")]
    fn = Flaky(*errors)
    seen: list[tuple[int, BaseException, float]] = []
    p = policy(fake, attempts=5, initial=0.5, maximum=10.0)
    assert p.call(fn, retry_if=always, on_retry=lambda *a: seen.append(a)) == "ok"
    assert len(fn.starts) == 3
    assert [(n, e) for n, e, _ in seen] == [(1, errors[0]), (2, errors[1])]
    assert [d for _, _, d in seen] == fake.slept  # on_retry is told the delay it gets
    assert all(0 <= d <= p.cap(n) for n, _, d in seen)


@pytest.mark.parametrize("attempts", [1, 2, 4])
def test_call_makes_at_most_attempts_calls_then_raises_the_last_error(attempts: int) -> None:
    fake = FakeTime()
    errors = [TimeoutError(f"failure {i}") for i in range(10)]
    fn = Flaky(*errors)
    retries: list[int] = []
    with pytest.raises(TimeoutError) as info:
        policy(fake, attempts=attempts).call(
            fn, retry_if=always, on_retry=lambda n, e, d: retries.append(n)
        )
    assert info.value is errors[attempts - 1]
    assert len(fn.starts) == attempts
    assert retries == list(range(1, attempts))
    assert len(fake.slept) == attempts - 1
    plural = "attempt" if attempts == 1 else "attempts"
    assert notes(info.value) == [
        f"gave up after {attempts} {plural}, all that the retry policy "
        f"(attempts={attempts}) allows"
    ]


def test_an_error_retry_if_refuses_is_raised_at_once_without_a_note() -> None:
    fake = FakeTime()
    error = ValueError("a bug")
    fn = Flaky(error)
    asked: list[BaseException] = []

    def retry_if(exc: BaseException) -> bool:
        asked.append(exc)
        return False

    with pytest.raises(ValueError) as info:
        policy(fake).call(fn, retry_if=retry_if, on_retry=lambda *a: pytest.fail("retried"))
    assert info.value is error and asked == [error]
    assert len(fn.starts) == 1 and fake.slept == [] and notes(error) == []


def test_a_refused_error_after_retries_says_how_many_attempts_were_made() -> None:
    fake = FakeTime()
    fn = Flaky(TimeoutError("transient"), TimeoutError("transient"), ValueError("permanent"))
    with pytest.raises(ValueError) as info:
        policy(fake).call(fn, retry_if=lambda e: isinstance(e, TimeoutError))
    assert len(fn.starts) == 3 and len(fake.slept) == 2
    assert notes(info.value) == ["gave up after 3 attempts: this error is not retryable"]


def test_keyboard_interrupt_is_never_retried() -> None:
    fake = FakeTime()
    fn = Flaky(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        policy(fake).call(fn, retry_if=lambda e: pytest.fail("asked about an interrupt"))
    assert len(fn.starts) == 1


def test_an_error_in_on_retry_ends_the_loop() -> None:
    fake = FakeTime()
    fn = Flaky(TimeoutError("x"))

    def on_retry(n: int, exc: BaseException, delay: float) -> None:
        msg = "abort the sinks failed"
        raise RuntimeError(msg)

    with pytest.raises(RuntimeError, match="abort the sinks failed"):
        policy(fake).call(fn, retry_if=always, on_retry=on_retry)
    assert len(fn.starts) == 1 and fake.slept == []


# --- call: the deadline --------------------------------------------------------------------


def test_no_attempt_starts_after_the_deadline() -> None:
    fake = FakeTime()
    fn = Flaky(*[TimeoutError(str(i)) for i in range(100)], took=1.0, fake=fake)
    p = policy(fake, attempts=100, initial=0.0, deadline=5.0)  # no waits: calls take 1 s
    with pytest.raises(TimeoutError) as info:
        p.call(fn, retry_if=always)
    assert fn.starts == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert notes(info.value) == [
        "gave up after 6 attempts in 6s: the next one would start past the retry policy's "
        "deadline of 5s"
    ]


def test_the_deadline_is_kept_without_sleeping_past_it() -> None:
    fake = FakeTime()
    fn = Flaky(*[TimeoutError(str(i)) for i in range(100)], took=0.25, fake=fake)
    p = policy(fake, attempts=100, initial=1.0, maximum=1.0, multiplier=1.0, deadline=3.0)
    with pytest.raises(TimeoutError):
        p.call(fn, retry_if=always)
    assert len(fn.starts) >= 3  # a few fit...
    assert all(start <= 3.0 for start in fn.starts)  # ...none starts late...
    assert fake.now <= 3.0 + 0.25  # ...so the whole call ends within one call of it


@given(
    took=st.lists(st.floats(0, 3, allow_nan=False), min_size=1, max_size=40),
    deadline=st.floats(0, 20, allow_nan=False),
    attempts=st.integers(1, 50),
    initial=st.floats(0, 5, allow_nan=False),
    seed=st.integers(0, 1000),
)
def test_attempts_and_deadline_always_bound_a_call(
    took: list[float], deadline: float, attempts: int, initial: float, seed: int
) -> None:
    fake = FakeTime()
    starts: list[float] = []
    durations = iter(took * 50)

    def fail() -> None:
        starts.append(fake.now)
        fake.now += next(durations)
        msg = "still down"
        raise TimeoutError(msg)

    p = RetryPolicy(attempts=attempts, initial=initial, maximum=4.0, deadline=deadline,
                    sleep=fake.sleep, clock=fake.clock, rng=random.Random(seed))
    with pytest.raises(TimeoutError):
        p.call(fail, retry_if=always)
    assert 1 <= len(starts) <= attempts
    assert all(s <= deadline for s in starts)
    assert fake.now <= max(deadline, 0.0) + max(took) + 1e-9
    assert len(fake.slept) == len(starts) - 1


def test_allows_answers_for_loops_that_keep_their_own_structure() -> None:
    p = RetryPolicy(attempts=3, deadline=10.0)
    assert p.allows(1) and p.allows(2, elapsed=9.0, delay=1.0)
    assert not p.allows(3)  # three calls failed: that is all attempts=3 allows
    assert not p.allows(1, elapsed=9.5, delay=0.6)  # would start past the deadline
    assert RetryPolicy(attempts=2).allows(1, elapsed=1e9, delay=1e9)  # no deadline


# --- what the engine needs ------------------------------------------------------------------


@pytest.mark.parametrize("batch_retries", [0, 1, 3])
def test_batch_retries_map_onto_the_policy(batch_retries: int) -> None:
    # EngineOptions(batch_retries, retry_backoff=0.5): doubling from retry_backoff, no cap.
    fake = FakeTime()
    p = policy(fake, attempts=batch_retries + 1, initial=0.5, maximum=math.inf)
    assert p.retries == batch_retries
    assert [p.cap(n) for n in range(1, batch_retries + 1)] == [
        0.5 * 2**i for i in range(batch_retries)
    ]
    fn = Flaky(*[OSError("executor lost")] * (batch_retries + 1))
    with pytest.raises(OSError):
        p.call(fn, retry_if=always)
    assert len(fn.starts) == batch_retries + 1


def test_element_retries_map_onto_the_policy() -> None:
    # ErrorPolicy(retries=4, backoff=0.1, max_backoff=0.3)
    fake = FakeTime()
    p = policy(fake, attempts=5, initial=0.1, maximum=0.3)
    assert [p.cap(n) for n in range(1, 5)] == [0.1, 0.2, 0.3, 0.3]
    fn = Flaky(*[ValueError("bad element")] * 4, value="written")
    assert p.call(fn, retry_if=always) == "written"
    assert len(fn.starts) == 5 and all(d <= 0.3 for d in fake.slept)


def test_a_policy_pickles_and_compares_by_its_bounds() -> None:
    p = RetryPolicy(attempts=3, initial=0.2, maximum=2.0, multiplier=3.0, deadline=9.0)
    copy = pickle.loads(pickle.dumps(p))
    assert copy == p and copy.deadline == 9.0
    assert 0 <= copy.delay(2) <= 0.6
    assert RetryPolicy(sleep=lambda s: None) == RetryPolicy()  # seams are not compared


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"attempts": 0}, "use 1 or more"),
    ({"initial": -1.0}, "initial and maximum >= 0"),
    ({"maximum": -0.5}, "initial and maximum >= 0"),
    ({"initial": math.nan}, "initial and maximum >= 0"),
    ({"multiplier": 0.5}, "multiplier >= 1"),
    ({"deadline": -1.0}, "seconds >= 0"),
    ({"deadline": math.nan}, "seconds >= 0"),
])
def test_a_bad_policy_names_the_fix(kwargs: dict[str, float], fix: str) -> None:
    with pytest.raises(ValueError, match=fix) as info:
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith("RetryPolicy(")


def test_the_seams_default_to_real_time() -> None:
    import time

    p = RetryPolicy()
    clock: Callable[[], float] = p.clock
    assert p.sleep is time.sleep and clock is time.monotonic


def test_cdcflow_s_own_refusal_after_retries_carries_no_note() -> None:
    """A lease held or lost, refused after a transient failure, is the whole message:
    "...; take over now with --takeover; gave up after 2 attempts: this error is not
    retryable" contradicted itself, and only on some runs."""
    from cdcflow.errors import LeaseHeldError

    fake = FakeTime()
    refusal = LeaseHeldError("pipeline 'p' is being run by vm:1")
    fn = Flaky(TimeoutError("transient"), refusal)
    with pytest.raises(LeaseHeldError) as info:
        policy(fake).call(fn, retry_if=lambda e: isinstance(e, TimeoutError))
    assert info.value is refusal and notes(refusal) == [] and len(fn.starts) == 2
