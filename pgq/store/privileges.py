"""Does the role a consumer runs as have every privilege it needs?

`require_consumer_privileges` asks the catalogs in one statement and raises
`PermissionDenied` naming every privilege the role lacks, so a member that could
not do its whole job (open the group's breaker, run retention, leave) refuses to
start instead of failing later, task by task. Run it through `run_once` or a
`RoleConnection` (they translate driver errors).
"""

from __future__ import annotations

from sqlalchemy import Connection

from pgq.errors import PermissionDenied
from pgq.sql import privileges as privileges_sql
from pgq.store.engine import schema_of

ORDER = ["USAGE", "SELECT", "INSERT", "UPDATE", "DELETE"]
"""The order privileges are named in."""


def require_consumer_privileges(conn: Connection) -> None:
    """Raise `PermissionDenied` naming every privilege a consumer needs on the
    schema that the current role lacks (nothing when it has them all)."""
    schema = schema_of(conn)
    rows = conn.execute(privileges_sql.missing_consumer_privileges(), {"schema": schema}).all()
    if not rows:
        return
    role = str(conn.execute(privileges_sql.current_role()).scalar_one())
    lacking: dict[str, list[str]] = {}
    for kind, privilege in rows:
        lacking.setdefault(kind, []).append(privilege)
    order = ["schema", *privileges_sql.CONSUMER_TABLES, *privileges_sql.CONSUMER_SEQUENCES]
    missing = "; ".join(
        f"{', '.join(sorted(lacking[kind], key=ORDER.index))} on "
        + (f"schema {schema}" if kind == "schema" else f"{schema}.{kind}")
        for kind in order
        if kind in lacking
    )
    raise PermissionDenied(
        f"role {role!r} lacks privileges a consumer needs: {missing}"
        f" (pgq grant {role!r} --consumer grants them)"
    )
