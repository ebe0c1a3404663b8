"""The consumer: `Consumer` (the facade) and the member's threads."""

from pgq.consumer.consumer import Consumer
from pgq.consumer.prober import PROBE_THREAD

__all__ = ["PROBE_THREAD", "Consumer"]
