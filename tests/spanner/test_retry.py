"""Transient error classification and jittered, capped backoff."""

from __future__ import annotations

import random

import grpc
import pytest
from google.api_core import exceptions as gexc

from cdcflow.spanner.retry import RetryPolicy, is_transient, status_name


@pytest.mark.parametrize(("error", "transient"), [
    (gexc.ServiceUnavailable("x"), True),
    (gexc.Aborted("x"), True),
    (gexc.DeadlineExceeded("x"), True),
    (gexc.ResourceExhausted("x"), True),
    (gexc.InternalServerError("Received unexpected EOS on DATA frame from server"), True),
    (gexc.InternalServerError("stream terminated by RST_STREAM with error code: 2"), True),
    (gexc.InternalServerError("a bug in the server"), False),
    (gexc.PermissionDenied("x"), False),
    (gexc.InvalidArgument("x"), False),
    (gexc.NotFound("x"), False),
    (ValueError("x"), False),
])
def test_is_transient(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient


def test_status_name_of_raw_grpc_errors() -> None:
    class RawError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "socket closed"

    assert status_name(RawError()) == "UNAVAILABLE"
    assert is_transient(RawError())


def test_full_jitter_stays_under_the_capped_exponential() -> None:
    policy = RetryPolicy(initial=0.1, maximum=1.0, multiplier=2.0, rng=random.Random(7))
    for retry, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (30, 1.0)]:
        delays = [policy.delay(retry) for _ in range(200)]
        assert all(0.0 <= d <= cap for d in delays)
        assert max(delays) > cap * 0.8  # jitter spans the range, not a fixed value


def test_backoff_sleeps_the_delay() -> None:
    slept: list[float] = []
    policy = RetryPolicy(initial=1.0, sleep=slept.append, rng=random.Random(1))
    policy.backoff(3)
    assert len(slept) == 1 and 0 <= slept[0] <= 4.0


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"initial": -1}, {"multiplier": 0.5}])
def test_bad_policies(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
