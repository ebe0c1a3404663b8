"""Privileges on the schema: grant a role what its job needs, and check that the
role running a job has it.

`grant` runs the GRANT statements of `pgq.sql.privileges` for one job
(`pgq grant ROLE --producer | --consumer | --admin`) and `grant_sql` renders
them without running anything (`--print`): both give the same lines, and
`grant` runs exactly those. `require_consumer_privileges` asks the catalogs in
one statement and raises `PermissionDenied` naming every privilege a consumer's
role lacks, so a member that could not do its whole job (open the group's
breaker, run retention, leave) refuses to start instead of failing later, task
by task. Run it through `run_once` or a `RoleConnection` (they translate
driver errors).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, Engine
from sqlalchemy.sql import Executable

from pgq.errors import PermissionDenied, SchemaMissing, UnknownGroup, UnknownTopic, UsageError
from pgq.names import check_name
from pgq.sql import privileges as privileges_sql
from pgq.sql import restrictions as restrictions_sql
from pgq.sql.locks import lock_key, xact_lock
from pgq.store.engine import schema_of
from pgq.store.errors import wrap_errors

ORDER = ["USAGE", "SELECT", "INSERT", "UPDATE", "DELETE"]
"""The order privileges are named in."""

JOBS = tuple(privileges_sql.JOBS)
"""The jobs a role can be granted: `producer`, `consumer`, `admin`."""

MAX_ROLE_BYTES = 63
"""PostgreSQL's longest name: a longer one would be cut to another role's name."""

RESERVED_ROLES = ("public", "none")
"""Names PostgreSQL takes as keywords even when quoted (`public` is every role)."""


def check_role_name(role: object) -> str:
    """`role` if it can name a role as a quoted identifier, else `UsageError`: 1 to
    63 bytes of printable characters (no control characters: one statement per
    line), not `public` nor `none`, not starting with `pg_` (reserved)."""
    if not isinstance(role, str) or not role:
        raise UsageError("invalid role name: give the name of an existing role")
    if not role.isprintable():  # a lone surrogate is not printable either
        raise UsageError(f"invalid role name {role!r}: printable characters only")
    if len(role.encode()) > MAX_ROLE_BYTES:
        raise UsageError(f"invalid role name {role[:70]!r}: at most {MAX_ROLE_BYTES} bytes")
    if role in RESERVED_ROLES or role.startswith("pg_"):
        raise UsageError(f"invalid role name {role!r}: reserved by PostgreSQL")
    return role


def _job(job: str) -> privileges_sql.Job:
    if job not in privileges_sql.JOBS:
        raise UsageError(f"unknown job {job!r}: use one of {', '.join(JOBS)}")
    return privileges_sql.JOBS[job]


def grant_sql(schema: str, role: str, job: str) -> list[str]:
    """The GRANT statements (one line each) that give `role` exactly what
    `job` needs on `schema`; nothing is run. Raises `UsageError` for a bad role
    name or job."""
    _job(job)
    check_role_name(role)
    return [s.as_string(None) for s in privileges_sql.grant_statements(job, schema, role)]


def grant(
    engine: Engine,
    role: str,
    job: str,
    *,
    topics: Sequence[str] = (),
    groups: Sequence[str] = (),
    dry_run: bool = False,
) -> list[str]:
    """Grant `role` exactly what `job` needs on the engine's schema, in one
    transaction; return the statements run (`grant_sql`'s, in order, then the
    restriction's).

    With `topics` and/or `groups` the role is restricted to those rows
    (row-level security, `pgq.sql.restrictions`): it replaces whatever
    restriction the role had; without them a restriction the role had is lifted.
    `dry_run` returns the same statements and runs none (`pgq grant --print`
    with `--topic`/`--group`: the ids are read from the database).

    Idempotent (GRANT again changes nothing; privileges the role has besides
    are left alone). Raises `UsageError` when the role does not exist or a
    topic or group is unknown, `SchemaMissing` before `pgq init`, and
    `PermissionDenied` when the role running this may not grant all of it
    (PostgreSQL refuses, or only warns for what it holds without the grant
    option): then nothing is granted.
    """
    schema = schema_of(engine)
    statements = grant_sql(schema, role, job)
    _check_restriction(job, topics, groups)
    owner = f"run pgq grant as the owner of schema {schema} (the role that ran pgq init)"
    try:
        grantor, ran, lacking = _grant(
            engine, schema, role, job, statements, topics, groups, dry_run
        )
    except SchemaMissing:
        raise SchemaMissing(
            f"schema {schema} is not installed or not up to date: run `pgq init`"
        ) from None
    except PermissionDenied as exc:
        raise PermissionDenied(f"{exc}; {owner}; nothing granted") from None
    if lacking:
        raise PermissionDenied(
            f"role {grantor!r} cannot grant {_named(schema, job, lacking)} to {role!r};"
            f" {owner}; nothing granted"
        )
    return ran


def _check_restriction(job: str, topics: Sequence[str], groups: Sequence[str]) -> None:
    """`UsageError` for a name that cannot be a topic's or a group's, or a producer
    restricted by group (it publishes to topics)."""
    for topic in topics:
        check_name("topic", topic)
    for group in groups:
        check_name("group", group)
    if groups and job == "producer":
        raise UsageError("--group is for --consumer and --admin: restrict a producer by --topic")


def _grant(
    engine: Engine,
    schema: str,
    role: str,
    job: str,
    statements: list[str],
    topics: Sequence[str],
    groups: Sequence[str],
    dry_run: bool,
) -> tuple[str, list[str], list[tuple[str, str]]]:
    """Run `statements` and the restriction's; return the role that ran them, the
    statements, and what `role` still lacks (then the transaction is rolled back;
    with `dry_run` it always is, and nothing was run).

    Holds `pgq init`'s lock on the schema until it commits: GRANT rewrites each
    table's catalog row, and two at once on one table fail one of them ("tuple
    concurrently updated"); so grants run one at a time, and after an upgrade in
    progress, on the tables it leaves."""
    with wrap_errors(), engine.connect() as conn, conn.begin() as transaction:
        if not conn.execute(privileges_sql.role_exists(), {"role": role}).scalar_one():
            raise UsageError(f"role {role!r} does not exist")
        conn.execute(xact_lock(lock_key(schema, "migrate")))
        statements = statements + restriction_sql(conn, schema, role, topics, groups)
        grantor = str(conn.execute(privileges_sql.current_role()).scalar_one())
        if dry_run:
            transaction.rollback()
            return grantor, statements, []
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cur:
            for statement in statements:
                cur.execute(statement)  # no parameters: the text is sent as printed
        params = {"schema": schema, "role": role}
        found = conn.execute(privileges_sql.missing_privileges(job, of_role=True), params).all()
        if found:
            transaction.rollback()
        return grantor, statements, [(str(kind), str(privilege)) for kind, privilege in found]


def restriction_sql(
    conn: Connection, schema: str, role: str, topics: Sequence[str], groups: Sequence[str]
) -> list[str]:
    """The statements that restrict existing `role` to `topics` and `groups` (names),
    replacing its restriction; with neither, the ones that lift it (none when it
    has none). Raises `UnknownTopic` / `UnknownGroup` for a name not in the schema.

    Row-level security and `pgq_all` are turned on once, by the first
    restriction, and stay: they cost unrestricted roles nothing (decision 0034)."""
    q = restrictions_sql
    oid = int(conn.execute(q.role_oid(), {"role": role}).scalar_one())
    comments = {(str(a), str(b)): c for a, b, c in conn.execute(q.policies(), {"schema": schema})}
    mine = set(q.policy_names(oid))
    statements = q.drop_statements(schema, [p for p in comments if p in mine])
    if topics or groups:
        if conn.execute(q.bypasses(), {"schema": schema, "role": role}).scalar_one():
            raise UsageError(
                f"role {role!r} bypasses row-level security (a superuser, BYPASSRLS, or"
                " the tables' owner): --topic/--group cannot restrict it; nothing granted"
            )
        topic_ids = _ids(conn, q.topics_named(), topics, UnknownTopic, "topic")
        found = conn.execute(q.groups_named(), {"names": list(groups)}).mappings().all()
        _all_known(groups, {row["name"] for row in found}, UnknownGroup, "group")
        group_ids = [int(row["id"]) for row in found]
        allowed = ([*topic_ids, *(int(row["topic_id"]) for row in found)], topic_ids, group_ids)
        enabled = [str(e) for e in conn.execute(q.secured_tables(), {"schema": schema}).scalars()]
        opened = [name for name, policy in comments if policy == q.OPEN_POLICY]
        opening = q.open_statements(schema, enabled, opened)
        same = comments.get(("topic", q.only_policy(oid))) == q.fingerprint(*allowed)
        if same and not opening and mine <= set(comments):
            return []  # restricted so already: no statement, no lock
        statements = [*opening, *statements, *q.restrict_statements(schema, role, oid, *allowed)]
    return [s.as_string(None) for s in statements]


def _ids(
    conn: Connection, query: Executable, names: Sequence[str], error: type[UsageError], kind: str
) -> list[int]:
    """The ids of `names` by `query` (id, name); `error` names the first unknown one."""
    rows = conn.execute(query, {"names": list(names)}).all()
    _all_known(names, {str(name) for _, name in rows}, error, kind)
    return [int(i) for i, _ in rows]


def _all_known(names: Sequence[str], known: set[str], error: type[UsageError], kind: str) -> None:
    unknown = [n for n in names if n not in known]
    if unknown:
        raise error(f"unknown {kind} {unknown[0]!r}: nothing granted")


def _named(schema: str, job: str, rows: list[tuple[str, str]]) -> str:
    """`SELECT, DELETE on s.message; UPDATE on s.message.created_at; USAGE on schema s`
    for (object, privilege) rows (the object of a column privilege is `table.column`)."""
    lacking: dict[str, list[str]] = {}
    for kind, privilege in rows:
        lacking.setdefault(kind, []).append(privilege)
    need = _job(job)
    order = ["schema", *need.tables, *need.sequences]
    return "; ".join(
        f"{', '.join(sorted(lacking[kind], key=ORDER.index))} on "
        + (f"schema {schema}" if kind == "schema" else f"{schema}.{kind}")
        for kind in order
        if kind in lacking
    )


def carry_grants(conn: Connection, table: str, carried: privileges_sql.Carried) -> list[str]:
    """Grant on the new `table` what each role's privileges on older tables say its
    job is (`carried`: `PROBE_LOG_CARRIED`, `GROUP_STATE_CARRIED`); returns the
    statements run. Runs in a migration's transaction, as the role that runs
    `pgq init`."""
    schema = schema_of(conn)
    statements = []
    for (had_on, had), privileges in carried.items():
        params = {"schema": schema, "table": had_on, "privilege": had}
        for role in conn.execute(privileges_sql.grantees(), params).scalars():
            grant = privileges_sql.grant_statement("TABLE", schema, table, privileges, role)
            statements.append(grant.as_string(None))
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cur:
        for statement in statements:
            cur.execute(statement)  # no parameters: the text as rendered
    return statements


def carry_restrictions(conn: Connection, table: str) -> list[str]:
    """Restrict the new group-keyed `table` as the group tables are for every role
    restricted to some topics and groups (`pgq_only_<oid>` on `probe`); returns the
    statements run (none where no role was ever restricted). Runs in a migration's
    transaction, as the role that runs `pgq init`."""
    q = restrictions_sql
    schema = schema_of(conn)
    prefix = q.only_policy(0)[:-1]
    oids = [
        int(policy[len(prefix) :])
        for name, policy, _ in conn.execute(q.policies(), {"schema": schema})
        if name == "probe" and str(policy).startswith(prefix)
    ]
    secured = set(conn.execute(q.secured_tables(), {"schema": schema}).scalars())
    if "probe" not in secured:
        return []
    roles = [(int(o), str(n)) for o, n in conn.execute(q.role_names(), {"oids": oids})]
    statements = [s.as_string(None) for s in q.carry_statements(schema, table, sorted(roles))]
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cur:
        for statement in statements:
            cur.execute(statement)  # no parameters: the text as rendered
    return statements


def require_privileges(conn: Connection, job: str) -> None:
    """Raise `PermissionDenied` naming every privilege `job` needs on the schema
    that the current role lacks (nothing when it has them all)."""
    schema = schema_of(conn)
    found = conn.execute(privileges_sql.missing_privileges(job), {"schema": schema}).all()
    if not found:
        return
    rows = [(str(kind), str(privilege)) for kind, privilege in found]
    role = str(conn.execute(privileges_sql.current_role()).scalar_one())
    article = "an" if job[0] in "aeiou" else "a"
    raise PermissionDenied(
        f"role {role!r} lacks privileges {article} {job} needs: {_named(schema, job, rows)}"
        f" (pgq grant {role!r} --{job} grants them)"
    )


def require_consumer_privileges(conn: Connection) -> None:
    """Raise `PermissionDenied` naming every privilege a consumer needs on the
    schema that the current role lacks (nothing when it has them all)."""
    require_privileges(conn, "consumer")
