"""Handlers for the attack scripts' `pgq consume --handler attack_handlers:NAME` runs."""

import os
import time

import pgq


class RpcError(Exception):
    """A common user pattern: an error object forwarding attribute reads to its payload
    dict (`__getattr__` raises KeyError, not AttributeError, for a missing field)."""

    def __init__(self, payload):
        super().__init__(payload.get("message", "rpc failed"))
        self.payload = payload

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.__dict__["payload"][name]


class RawRpcError(RpcError):
    """The same without the dunder guard: even Python's traceback printing trips on it."""

    def __getattr__(self, name):
        return self.__dict__["payload"][name]


def rpc_error(msg):
    raise RpcError({"message": "upstream said no", "code": 17})


def raw_rpc_error(msg):
    raise RawRpcError({"message": "upstream said no", "code": 17})


class Throttled(pgq.RetryLater):
    """A RetryLater subclass that computes its delay lazily (a property)."""

    def __init__(self, retry_after_header):
        self.header = retry_after_header
        super().__init__(0, f"throttled, retry after {retry_after_header}")

    @property
    def delay(self):  # the header as given: "120"
        return self.header

    @delay.setter
    def delay(self, value):
        pass


def throttled(msg):
    raise Throttled("120")


def ok(msg):
    time.sleep(float(os.environ.get("ATK_SLEEP", "0")))


def slow_log(msg):
    """Log `start`/`ok` with the member tag and pid, sleeping ATK_SLEEP seconds."""
    path = os.path.join(os.environ["ATK_DIR"], f"log-{os.getpid()}")
    tag = os.environ.get("ATK_TAG", "?")
    with open(path, "a") as f:
        f.write(f"{time.time():.3f} {tag} {os.getpid()} {msg.id} {msg.attempt} start\n")
    time.sleep(float(os.environ.get("ATK_SLEEP", "0")))
    with open(path, "a") as f:
        f.write(f"{time.time():.3f} {tag} {os.getpid()} {msg.id} {msg.attempt} ok\n")
