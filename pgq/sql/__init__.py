"""pgq's SQL, as SQLAlchemy Core statements grouped by concern.

Nothing outside this package builds SQL. Each module holds the statements of
one concern, named for what they do; `pgq.store` runs them.
"""
