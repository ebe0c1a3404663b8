"""PostgreSQL's system catalogs, as far as pgq reads them: one lightweight `table`
each, with every column any of pgq's statements uses (`pg_catalog` is the same on
every server, so these are never created nor translated to pgq's schema)."""

from __future__ import annotations

from sqlalchemy import Boolean, column, table

namespaces = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")

classes = table(
    "pg_class",
    column("oid"),
    column("relname"),
    column("relnamespace"),
    column("relkind"),
    column("relowner"),
    column("relacl"),
    column("relrowsecurity"),
    schema="pg_catalog",
)

attributes = table(
    "pg_attribute",
    column("attrelid"),
    column("attname"),
    column("attnum"),
    column("attisdropped"),
    schema="pg_catalog",
)

roles = table(
    "pg_roles",
    column("oid"),
    column("rolname"),
    column("rolsuper", Boolean),
    column("rolbypassrls", Boolean),
    schema="pg_catalog",
)

policies = table(
    "pg_policy",
    column("oid"),
    column("polname"),
    column("polrelid"),
    schema="pg_catalog",
)
