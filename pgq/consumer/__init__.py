"""The consumer: a group member's threads around a buffered-claim pool."""

from pgq.consumer.consumer import Consumer

__all__ = ["Consumer"]
