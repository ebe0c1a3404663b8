"""`pgq web`'s own usage errors: one line, exit 2, never a traceback."""

from __future__ import annotations

import pytest
from helpers import invoke

pytest.importorskip("flask")


@pytest.mark.parametrize("host", ["bad host", "999.1.1.1", ""])
def test_an_address_that_is_not_this_machines_is_one_line(engine, pgq_env, host):
    result = invoke(pgq_env, "web", "--host", host, "--port", "0")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"pgq: error: cannot listen on {host!r}: not an address of this machine"
    ]
