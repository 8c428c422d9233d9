"""What vllm-sync applies to a vLLM that serves an older version than announced."""

from __future__ import annotations

from harnessrl.services.inference.vllm_sync import PolicyBook
from harnessrl.v1 import events_pb2 as pb


def _version(n: int) -> pb.PolicyVersion:
    return pb.PolicyVersion(version=n, step=n, weightsync_address=f"trainer:{n}")


def test_a_restarted_vllm_gets_the_newest_announced_version() -> None:
    book = PolicyBook()
    assert book.target(0) is None  # nothing announced yet
    for n in (2, 1, 3):  # a replay may come out of order; the newest counts
        book.announced(_version(n))
    book.outcome(3, ok=True)
    assert book.target(3) is None  # it serves the newest
    assert book.target(0) == _version(3)  # restarted on its initial weights


def test_a_refused_newest_version_falls_back_to_the_newest_loaded() -> None:
    book = PolicyBook()
    book.announced(_version(3))
    book.outcome(3, ok=True)
    book.announced(_version(4))
    book.outcome(4, ok=False)  # refused (or gone): not tried again
    assert book.target(3) is None
    assert book.target(0) == _version(3)
    book.outcome(2, ok=True, event=_version(2))  # an older load does not replace it
    assert book.loaded == _version(3)
