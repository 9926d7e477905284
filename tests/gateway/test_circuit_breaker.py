"""gateway/serving/circuit_breaker.py: closed -> open after N consecutive failures -> half-open after the
cooldown -> closed on a success or open again on a failure."""

from gateway.serving.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreakers


def test_breaker_opens_after_consecutive_failures_and_recovers():
    now = [0.0]
    b = CircuitBreakers(failures=3, open_s=10.0, clock=lambda: now[0])
    assert not b.record_failure("w") and not b.record_failure("w")
    b.record_success("w")  # a success in between resets the count
    assert [b.record_failure("w") for _ in range(3)] == [False, False, True]
    assert b.state("w") == OPEN and not b.allows("w") and b.open_workers() == ["w"]
    assert b.allows("other") and b.state("other") == CLOSED
    now[0] = 9.9
    assert b.state("w") == OPEN
    now[0] = 10.0
    assert b.state("w") == HALF_OPEN and b.allows("w")
    assert b.record_failure("w")  # one failure in half-open opens it again, for a full cooldown
    now[0] = 19.0
    assert b.state("w") == OPEN
    now[0] = 20.5
    b.record_success("w")
    assert b.state("w") == CLOSED and b.opened_total == 2
