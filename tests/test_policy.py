"""ErrorPolicy: the default decision reproduces retries/backoff/then; a handler decides per
failure, and the engine's chain asks it (retry after its delay, skip to the dead letter, stop)."""

from __future__ import annotations

import math
import pickle
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
import cdcflow.testing
from cdcflow.errors import ConfigurationError, PipelineStopped
from cdcflow.policy import Decision, ErrorPolicy, FailedElement, Retry, Skip, Stop
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, Map, ReadChangeStream

# The functions below run in tasks, which get pickled copies: they travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S


def test_default_decision_retries_then_stops_or_skips() -> None:
    err = ValueError("boom")
    stop = ErrorPolicy(retries=2, backoff=0.1, max_backoff=0.15)
    first, second = stop.decide(err, "x", "tok", 1), stop.decide(err, "x", "tok", 2)
    assert isinstance(first, Retry) and 0 <= first.after <= 0.1
    assert isinstance(second, Retry) and 0 <= second.after <= 0.15  # capped, not 0.2
    assert stop.decide(err, "x", "tok", 3) == Stop()
    skip = ErrorPolicy(retries=2, then="skip")
    assert skip.decide(err, "x", "tok", 3) == Skip()
    assert ErrorPolicy(retries=0).decide(err, "x", "tok", 1) == Stop()
    # the decision agrees with the RetryPolicy the retries always mapped to
    retry = stop.retry_policy()
    assert [retry.allows(n) for n in (1, 2, 3)] == [
        isinstance(stop.decide(err, "x", "tok", n), Retry) for n in (1, 2, 3)
    ]


def test_default_delays_are_jittered_within_the_doubling_cap() -> None:
    policy = ErrorPolicy(retries=10, backoff=0.01, max_backoff=0.05)
    for attempt, cap in ((1, 0.01), (2, 0.02), (3, 0.04), (4, 0.05), (9, 0.05)):
        delays = []
        for _ in range(50):
            decision = policy.decide(OSError(), None, "tok", attempt)
            assert isinstance(decision, Retry)
            delays.append(decision.after)
        assert all(0 <= d <= cap for d in delays)
        assert len(set(delays)) > 1  # full jitter, not a fixed wait


def test_handler_decides_every_failure_and_replaces_retries() -> None:
    seen: list[tuple[type[Exception], Any, str, int]] = []

    def handler(error: Exception, element: Any, token: str, attempt: int) -> Decision:
        seen.append((type(error), element, token, attempt))
        if isinstance(error, ConnectionError):
            return Retry(after="250ms")
        return Skip() if isinstance(error, ValueError) else Stop()

    policy = ErrorPolicy(retries=0, then="stop", handler=handler)
    assert policy.decide(ConnectionError(), "a", "t1", 7) == Retry(0.25)
    assert policy.decide(ValueError(), "b", "t2", 1) == Skip()  # though then="stop"
    assert policy.decide(KeyError(), "c", "t3", 1) == Stop()
    assert seen == [
        (ConnectionError, "a", "t1", 7), (ValueError, "b", "t2", 1), (KeyError, "c", "t3", 1)
    ]


def test_handler_must_answer_with_a_decision() -> None:
    policy = ErrorPolicy(handler=lambda e, el, tok, n: "retry")  # type: ignore[arg-type,return-value]
    # a fault of the handler, found as the pipeline runs: it stops on an error (exit 1),
    # whether the handler answers wrongly or raises (it gave exit 2 for the first)
    answer = r"returned 'retry' .* return Retry\(after=seconds\), Skip\(\) or Stop\(\)"
    with pytest.raises(PipelineStopped, match=answer):
        policy.decide(ValueError(), 1, "tok", 1)

    def broken(e: Exception, el: object, tok: str, n: int) -> Decision:
        raise KeyError("oops")

    raised = (r"handler broken raised KeyError: 'oops' deciding about ValueError: bad "
              r"\(partition tok, attempt 2\)")
    with pytest.raises(PipelineStopped, match=raised):
        ErrorPolicy(handler=broken).decide(ValueError("bad"), 1, "tok", 2)
    with pytest.raises(TypeError, match="must be a function"):
        ErrorPolicy(handler="skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="numbered from 1"):
        ErrorPolicy().decide(ValueError(), 1, "tok", 0)


def test_policy_numbers_are_checked_where_the_policy_is_made() -> None:
    """Not at the first failure, deep in a run."""
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(ValueError, match=r"ErrorPolicy\(retries=.*whole number >= 0"):
            ErrorPolicy(retries=bad)  # type: ignore[arg-type]
    for name in ("backoff", "max_backoff"):
        for value in (-5, math.nan, math.inf):
            with pytest.raises(ValueError, match=f"ErrorPolicy\\({name}=.*finite number"):
                ErrorPolicy(**{name: value})  # type: ignore[arg-type]
    for name in ("backoff", "max_backoff"):
        with pytest.raises(TypeError, match="True is not a time"):
            ErrorPolicy(**{name: True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dead_letter=<built-in function print>\): pass a sink"):
        ErrorPolicy(then="skip", dead_letter=print)  # type: ignore[arg-type]
    assert ErrorPolicy(backoff="250ms", max_backoff=0).retry_policy().maximum == 0
    # a duration that is not one names its argument
    with pytest.raises(ValueError, match=r"ErrorPolicy\(backoff='x'\): not a duration"):
        ErrorPolicy(backoff="x")
    with pytest.raises(ValueError, match=r"ErrorPolicy\(max_backoff=\[\]\): use seconds"):
        ErrorPolicy(max_backoff=[])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Retry\(after='soon'\): not a duration"):
        Retry(after="soon")


def test_retry_after_takes_seconds_or_durations_and_refuses_nonsense() -> None:
    assert Retry().after == 0 and Retry(2).after == 2.0 and Retry("1.5s").after == 1.5
    for bad in (-1, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite number of seconds"):
            Retry(bad)


def test_a_dead_letter_sink_goes_with_any_policy() -> None:
    """then='stop' with a dead letter: what a Consume's own on_error skips still has a
    place to go (it was refused, so a pipeline could not stop on its functions' errors and
    keep its consumer's skipped elements)."""
    assert ErrorPolicy(dead_letter=Collect()).then == "stop"
    policy = ErrorPolicy(dead_letter=Collect(), handler=lambda e, el, tok, n: Skip())
    assert policy.dead_letter is not None


def test_a_policy_with_a_lambda_handler_travels_pickled() -> None:
    policy = ErrorPolicy(handler=lambda e, el, tok, n: Retry(n / 10) if n < 3 else Skip())
    copy = pickle.loads(cloudpickle.dumps(policy))
    assert copy.decide(OSError(), 0, "t", 2) == Retry(0.2)
    assert copy.decide(OSError(), 0, "t", 3) == Skip()


# -- the engine's chain asks the handler ------------------------------------------------------


def _stream(n: int = 30) -> ScriptedChangeStream:
    s = ScriptedChangeStream("S", partitions=2, buckets=8, origin=T0)
    for i in range(n):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + i * S // 10)
    return s


def _value(r: cf.DataChangeRecord) -> int:
    return int(r.mods[0].new_values["v"])


class _Faulty:
    """``v % 10 == 3`` fails twice with ConnectionError, then works; ``v % 10 == 7`` always
    raises ValueError; ``v == stop_at`` raises KeyError. Retries of one element happen in
    one task, on this task's copy, so the per-element counts here see them."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.failures: Counter[int] = Counter()

    def __call__(self, r: cf.DataChangeRecord) -> int:
        v = _value(r)
        if v == self.stop_at:
            raise KeyError(v)
        if v % 10 == 7:
            msg = f"bad {v}"
            raise ValueError(msg)
        if v % 10 == 3 and self.failures[v] < 2:
            self.failures[v] += 1
            msg = f"flaky {v}"
            raise ConnectionError(msg)
        return v


def _handler(error: Exception, element: Any, token: str, attempt: int) -> Decision:
    assert isinstance(element, cf.DataChangeRecord) and element.partition_token == token
    if isinstance(error, ConnectionError):
        return Retry(after=0.001)
    return Skip() if isinstance(error, ValueError) else Stop()


def _pipeline(
    s: ScriptedChangeStream, out: Collect[Any], policy: ErrorPolicy, fn: _Faulty
) -> cf.Pipeline:
    p = cf.Pipeline("policy", error_policy=policy)
    p | ReadChangeStream(stream="S", start_at=T0, end_at=T0 + 5 * S, client=s) | Map(fn) | out
    return p


def test_chain_retries_skips_and_dead_letters_as_the_handler_says() -> None:
    s, out, dead = _stream(), Collect[Any](), "dead" >> Collect[Any]()
    assert isinstance(dead, Collect)
    policy = ErrorPolicy(retries=0, then="stop", dead_letter=dead, handler=_handler)
    summary = cdcflow.testing.run(_pipeline(s, out, policy, _Faulty()))
    assert summary.reason == "end reached"
    assert sorted(out.items) == [v for v in range(30) if v % 10 != 7]
    assert summary.retried == 2 * 3  # 3, 13, 23: two retries each, though retries=0
    assert summary.skipped == summary.dead_lettered == 3
    assert sorted(_value(f.element) for f in dead.items) == [7, 17, 27]
    assert all(isinstance(f, FailedElement) for f in dead.items)
    assert all(f.error.startswith("ValueError: bad") for f in dead.items)


def test_chain_stops_at_once_when_the_handler_says_stop() -> None:
    s, out = _stream(), Collect[Any]()
    policy = ErrorPolicy(retries=5, backoff=10, handler=_handler)  # no retries, no 10 s wait
    with pytest.raises(PipelineStopped, match=r"after 1 attempt\(s\): KeyError: 12"):
        cdcflow.testing.run(_pipeline(s, out, policy, _Faulty(stop_at=12)))
    assert 12 not in out.items


def test_a_configuration_error_stops_the_run_at_once_whatever_the_policy(
    tmp_path: Path,
) -> None:
    """A step that finds the pipeline's configuration wrong (LookupRows naming a column
    the table lacks) ends the run with that error at its first element: no retry, no skip
    (skipping would drop every change), not a PipelineStopped (exit 1) but the
    configuration error itself (exit 2 from the command line)."""
    calls = tmp_path / "calls"  # the task runs a pickled copy of the function

    def misconfigured(r: cf.DataChangeRecord) -> int:
        with calls.open("a") as f:
            f.write(f"{_value(r)}\n")
        msg = "LookupRows(columns=...): 'Nope' not in table 'T'; fix the column names"
        raise ConfigurationError(msg)

    for policy in (ErrorPolicy(retries=3, backoff=0.001), ErrorPolicy(then="skip"),
                   ErrorPolicy(handler=lambda *_: Skip())):
        calls.write_text("")
        p = cf.Pipeline("misconfigured", error_policy=policy)
        out = Collect[Any]()
        p | ReadChangeStream(stream="S", start_at=T0, end_at=T0 + 5 * S,
                             client=_stream()) | Map(misconfigured) | out
        with pytest.raises(ConfigurationError, match="'Nope' not in table"):
            cdcflow.testing.run(p)
        called = calls.read_text().split()
        # once in each of the two partitions' tasks at most: no element a second time
        assert 1 <= len(called) <= 2 and len(set(called)) == len(called)
        assert out.items == []
