"""What pgq may print about a database address (issue 21): never the user name or the
password, whatever the DSN looks like."""

from __future__ import annotations

import pytest

from pgq.errors import BadDsn
from pgq.store.engine import check_dsn, connect_failure, describe_dsn


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u:p@ss@db.example/app",  # a raw @ in the password
        "postgresql://us@er:pw@db.example/app",  # ... in the user name
        "postgresql://u:p/ss@db.example/app",  # a raw / in the password
        "postgres://u:p?x@y@db.example/app",
        "postgresql://u:pw@db.example/app@x",
    ],
)
def test_a_url_whose_userinfo_libpq_would_misread_is_refused(dsn):
    with pytest.raises(BadDsn) as caught:
        check_dsn(dsn)
    assert str(caught.value).startswith("invalid database address: an '@' or '/' in a URL's")
    for secret in ("p@ss", "ss@", "us@er", "pw", "p/ss", "p?x"):
        assert secret not in str(caught.value)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u:p%40ss@db.example/app",
        "postgresql://postgres@/postgres?host=/tmp/pgq&port=5432",  # the embedded server's
        "postgresql://u@db.example/app?options=-c%20x%3Dy&application_name=a@b",
        "postgresql://db.example/app?user=u&password=p@ss",
        "host=db.example user=u@corp password=p@ss/x dbname=app",
    ],
)
def test_a_dsn_libpq_reads_as_written_is_accepted(dsn):
    check_dsn(dsn)


def test_the_description_is_host_port_and_dbname_only():
    dsn = "postgresql://u%40corp:s3cret@db1.example:5432,db2.example:5433/app?sslmode=require"
    assert describe_dsn(dsn) == "host=db1.example,db2.example port=5432,5433 dbname=app"
    assert describe_dsn("host=/tmp/pgq port=5432 password=s3cret user=me") == (
        "host=/tmp/pgq port=5432"
    )
    assert describe_dsn("dbname='my app' password=s3cret") == "dbname=…"
    assert describe_dsn("not a dsn") == ""


def test_a_connection_error_loses_the_quoted_user_name_and_password_only():
    params = {"user": "x", "password": "pw", "host": "db1", "dbname": "app"}
    error = Exception(
        'connection failed: connection to server at "db1", port 5432 failed: FATAL:  role "x"'
        " does not exist\nmore"
    )
    assert connect_failure(error, params) == (
        'connection failed: connection to server at "db1", port 5432 failed: FATAL:  role "…"'
        " does not exist (host=db1 dbname=app)"
    )
    echo = Exception("invalid port number: \"pw\" or 'pw'")
    assert (
        connect_failure(echo, params) == "invalid port number: \"…\" or '…' (host=db1 dbname=app)"
    )
