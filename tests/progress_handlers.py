"""`outage_handlers.flaky` in a member whose progress line comes every
`TESTQ_PROGRESS_EVERY` seconds (the module sets `pgq.consumer.progress.PROGRESS_EVERY`
when `pgq consume` imports the handler, before the member starts)."""

from __future__ import annotations

import os

from outage_handlers import flaky

from pgq.consumer import progress

progress.PROGRESS_EVERY = float(os.environ.get("TESTQ_PROGRESS_EVERY", progress.PROGRESS_EVERY))

__all__ = ["flaky"]
