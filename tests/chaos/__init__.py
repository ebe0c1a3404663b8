"""Fault injection for pgq: a TCP proxy that cuts and stalls connections, real
member processes to kill and pause, concurrent publishers/subscribers/retention,
and a history checker that says whether anything was lost or run twice unexplained.

Modules: `proxy`, `procs`, `drivers`, `history`, `handlers` (the member handler
that logs every attempt). Importing this package imports nothing: member
processes import `chaos.handlers` alone.
"""
