"""The default failure classifier and the user hook wrapper (DESIGN §5)."""

from __future__ import annotations

import itertools
import logging
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgq.classify import default_classify, make_classifier
from pgq.errors import PermanentError, RetryLater, SystemicError


def fake(module: str, name: str, base: type[BaseException] = Exception) -> type[BaseException]:
    """A stand-in for a third-party exception class, without importing the library."""
    return type(name, (base,), {"__module__": module})


def chained(*excs: BaseException, how: str = "cause") -> BaseException:
    """Link excs so each is raised from (or while handling) the next; return the first."""
    for outer, inner in itertools.pairwise(excs):
        if how == "cause":
            outer.__cause__ = inner
        else:
            outer.__context__ = inner
    return excs[0]


@pytest.mark.parametrize(
    "exc",
    [
        SystemicError("down"),
        ConnectionError(),
        ConnectionRefusedError(),
        ConnectionResetError(),
        BrokenPipeError(),
        TimeoutError(),
        socket.gaierror(-2, "Name or service not known"),
    ],
)
def test_builtin_systemic(exc: BaseException) -> None:
    assert default_classify(exc) == "systemic"


@pytest.mark.parametrize(
    "exc", [ValueError(), KeyError("x"), OSError(), RuntimeError(), RetryLater(1.0)]
)
def test_everything_else_is_a_message_failure(exc: BaseException) -> None:
    assert default_classify(exc) == "message"


def test_permanent() -> None:
    assert default_classify(PermanentError("bad payload")) == "permanent"


def test_permanent_wins_over_its_chain() -> None:
    assert default_classify(chained(PermanentError(), ConnectionError())) == "permanent"


SYSTEMIC_BY_NAME = [
    ("requests.exceptions", "ConnectionError"),
    ("requests.exceptions", "Timeout"),
    ("httpx._exceptions", "TransportError"),
    ("httpx._exceptions", "ConnectError"),
    ("httpx._exceptions", "TimeoutException"),
    ("httpx._exceptions", "NetworkError"),
    ("httpx", "ConnectError"),
    ("urllib3.exceptions", "NewConnectionError"),
    ("urllib3.exceptions", "ConnectTimeoutError"),
    ("urllib3.exceptions", "ReadTimeoutError"),
    ("urllib3.exceptions", "MaxRetryError"),
    ("urllib3.exceptions", "ProtocolError"),
    ("psycopg", "OperationalError"),
    ("psycopg.errors", "OperationalError"),
    ("psycopg.errors", "ConnectionTimeout"),
    ("psycopg2", "OperationalError"),
    ("psycopg2.extensions", "OperationalError"),
    ("sqlalchemy.exc", "OperationalError"),
    ("sqlalchemy.exc", "DisconnectionError"),
    ("sqlalchemy.exc", "TimeoutError"),
]


@pytest.mark.parametrize(("module", "name"), SYSTEMIC_BY_NAME)
def test_third_party_systemic_by_name(module: str, name: str) -> None:
    assert default_classify(fake(module, name)()) == "systemic"


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("myapp", "OperationalError"),
        ("myapp.requests", "ConnectionError"),
        ("psycopg2x", "OperationalError"),
        ("psycopg_extra", "OperationalError"),
        ("httpx._exceptions", "HTTPStatusError"),
        ("httpx._exceptions", "DecodingError"),
        ("requests.exceptions", "HTTPError"),
        ("urllib3.exceptions", "LocationParseError"),
        ("psycopg.errors", "UniqueViolation"),
        ("sqlalchemy.exc", "IntegrityError"),
    ],
)
def test_third_party_non_systemic(module: str, name: str) -> None:
    assert default_classify(fake(module, name)()) == "message"


def test_subclasses_match_through_the_mro() -> None:
    timeout_exception = fake("httpx._exceptions", "TimeoutException")
    read_timeout = fake("httpx._exceptions", "ReadTimeout", timeout_exception)
    mine = fake("myapp.client", "UpstreamDown", read_timeout)
    assert default_classify(read_timeout()) == "systemic"
    assert default_classify(mine()) == "systemic"


def test_real_libraries_when_installed() -> None:
    psycopg = pytest.importorskip("psycopg")
    sa_exc = pytest.importorskip("sqlalchemy.exc")
    for cls in (
        psycopg.OperationalError,
        psycopg.errors.ConnectionTimeout,
        psycopg.errors.AdminShutdown,
        sa_exc.OperationalError,
        sa_exc.DisconnectionError,
        sa_exc.TimeoutError,
    ):
        assert default_classify(cls.__new__(cls)) == "systemic", cls
    for cls in (psycopg.errors.UniqueViolation, sa_exc.IntegrityError):
        assert default_classify(cls.__new__(cls)) == "message", cls


def test_real_requests_and_urllib3_when_installed() -> None:
    requests_exc = pytest.importorskip("requests.exceptions")
    urllib3_exc = pytest.importorskip("urllib3.exceptions")
    for cls in (
        requests_exc.ConnectionError,
        requests_exc.ConnectTimeout,
        requests_exc.ReadTimeout,
        urllib3_exc.NewConnectionError,
        urllib3_exc.ReadTimeoutError,
        urllib3_exc.MaxRetryError,
        urllib3_exc.ProtocolError,
    ):
        assert default_classify(cls.__new__(cls)) == "systemic", cls
    assert default_classify(requests_exc.HTTPError()) == "message"


class _Response:
    def __init__(self, status_code: object) -> None:
        self.status_code = status_code


def http_error(module: str, name: str, status: object) -> BaseException:
    """A stand-in for requests' `HTTPError` / httpx's `HTTPStatusError` with a response."""
    exc = fake(module, name)("HTTP error")
    exc.response = _Response(status)  # type: ignore[attr-defined]
    return exc


HTTP_ERRORS = [("requests.exceptions", "HTTPError"), ("httpx._exceptions", "HTTPStatusError")]


@pytest.mark.parametrize(("module", "name"), HTTP_ERRORS)
@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_http_unavailable_statuses_are_systemic(module: str, name: str, status: int) -> None:
    assert default_classify(http_error(module, name, status)) == "systemic"
    wrapped = chained(ValueError("while calling"), http_error(module, name, status))
    assert default_classify(wrapped) == "systemic"


@pytest.mark.parametrize(("module", "name"), HTTP_ERRORS)
@pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 500, 501, None, "503"])
def test_other_http_statuses_are_message_failures(module: str, name: str, status: object) -> None:
    assert default_classify(http_error(module, name, status)) == "message"


def test_http_status_only_for_requests_and_httpx() -> None:
    assert default_classify(http_error("myapp", "HTTPError", 503)) == "message"


def test_http_error_whose_response_cannot_answer_is_a_message_failure() -> None:
    class Broken:
        @property
        def status_code(self) -> int:
            raise RuntimeError("no")

    exc = fake("requests.exceptions", "HTTPError")()
    exc.response = Broken()  # type: ignore[attr-defined]
    assert default_classify(exc) == "message"


def test_real_requests_http_error_when_installed() -> None:
    requests = pytest.importorskip("requests")
    response = requests.Response()
    response.status_code = 503
    assert default_classify(requests.HTTPError(response=response)) == "systemic"
    response.status_code = 404
    assert default_classify(requests.HTTPError(response=response)) == "message"


# --- the cause/context chain ------------------------------------------------------


def test_systemic_cause() -> None:
    assert default_classify(chained(ValueError(), ConnectionError())) == "systemic"


def test_systemic_context() -> None:
    try:
        try:
            raise TimeoutError
        except TimeoutError:
            raise KeyError("x")  # noqa: B904 - the implicit context is the point
    except KeyError as exc:
        assert default_classify(exc) == "systemic"


def test_suppressed_context_is_not_followed() -> None:
    try:
        try:
            raise TimeoutError
        except TimeoutError:
            raise KeyError("x") from None
    except KeyError as exc:
        assert default_classify(exc) == "message"


def test_deep_chain() -> None:
    excs = [ValueError(i) for i in range(20)] + [SystemicError()]
    assert default_classify(chained(*excs, how="context")) == "systemic"


def test_chain_is_bounded() -> None:
    excs = [ValueError(i) for i in range(40)] + [SystemicError()]
    assert default_classify(chained(*excs)) == "message"


def test_cycle_terminates() -> None:
    a, b = ValueError("a"), KeyError("b")
    a.__context__, b.__context__ = b, a
    assert default_classify(a) == "message"
    c = ConnectionError()
    b.__cause__ = c
    c.__context__ = a
    assert default_classify(a) == "systemic"


pool = [ValueError, KeyError, RuntimeError, SystemicError, ConnectionError, TimeoutError]
systemic_types = (SystemicError, ConnectionError, TimeoutError)


@given(
    kinds=st.lists(st.sampled_from(pool), min_size=1, max_size=30),
    how=st.sampled_from(["cause", "context"]),
)
def test_chain_property(kinds: list[type[Exception]], how: str) -> None:
    exc = chained(*(k() for k in kinds), how=how)
    expected = "systemic" if any(issubclass(k, systemic_types) for k in kinds) else "message"
    assert default_classify(exc) == expected


# --- make_classifier -----------------------------------------------------------------


def test_no_hook_is_the_default() -> None:
    assert make_classifier(None) is default_classify


def test_user_hook_wins() -> None:
    classify = make_classifier(lambda exc: "message")
    assert classify(ConnectionError()) == "message"
    classify = make_classifier(lambda exc: "systemic")
    assert classify(PermanentError()) == "systemic"
    classify = make_classifier(lambda exc: "permanent")
    assert classify(ValueError()) == "permanent"


@pytest.mark.parametrize("value", [None, "SYSTEMIC", "retry", b"systemic", 1, ["message"]])
def test_invalid_hook_value_falls_back(value: object, caplog: pytest.LogCaptureFixture) -> None:
    classify = make_classifier(lambda exc: value)
    with caplog.at_level(logging.WARNING, logger="pgq.classify"):
        assert classify(ConnectionError()) == "systemic"
        assert classify(ValueError()) == "message"
    assert len(caplog.records) == 2
    record = caplog.records[0]
    assert record.levelno == logging.WARNING
    assert "invalid value" in record.getMessage()
    assert f"value={value!r}" in record.getMessage()
    assert "fallback=systemic" in record.getMessage()


def test_raising_hook_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    def hook(exc: BaseException) -> str:
        raise RuntimeError("hook bug")

    classify = make_classifier(hook)
    with caplog.at_level(logging.WARNING, logger="pgq.classify"):
        assert classify(PermanentError()) == "permanent"
    [record] = caplog.records
    assert "classify hook failed" in record.getMessage()
    assert "error=RuntimeError('hook bug')" in record.getMessage()
    assert "fallback=permanent" in record.getMessage()


def test_hook_keyboard_interrupt_propagates() -> None:
    def hook(exc: BaseException) -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_classifier(hook)(ValueError())


def test_transaction_conflicts_are_message_failures_even_wrapped():
    import psycopg.errors
    import sqlalchemy.exc

    serialization = psycopg.errors.SerializationFailure("could not serialize access")
    assert default_classify(serialization) == "message"
    assert default_classify(psycopg.errors.DeadlockDetected("deadlock")) == "message"
    wrapped = sqlalchemy.exc.OperationalError("UPDATE ...", {}, serialization)
    try:
        raise wrapped from serialization
    except sqlalchemy.exc.OperationalError as exc:
        assert default_classify(exc) == "message"
    assert default_classify(psycopg.OperationalError("server closed the connection")) == "systemic"
