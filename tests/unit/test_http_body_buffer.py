"""BodyBuffer: bodies come out intact whichever way they were kept, and the heap allowance
decides which way that is."""

from __future__ import annotations

import pytest

from harnessrl.http.body_budget import BodyBudget
from harnessrl.http.body_buffer import HEAP_BYTES_MAX, BodyBuffer

LIMIT = 8 * 1024 * 1024
BODY = bytes(range(256)) * 4096  # 1 MiB


def pieces_of(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


def test_a_body_in_one_piece_is_that_piece_uncopied() -> None:
    budget = BodyBudget(LIMIT)
    buffer = BodyBuffer(LIMIT, budget)
    buffer.begin(len(BODY))
    buffer.append(BODY)
    assert buffer.take() is BODY
    assert (buffer.size, budget.in_heap) == (0, 0)


@pytest.mark.parametrize("declared", [len(BODY), None])
def test_pieces_under_the_heap_allowance_stay_in_the_heap(declared: int | None) -> None:
    budget = BodyBudget(LIMIT)
    buffer = BodyBuffer(LIMIT, budget)
    buffer.begin(declared)
    for piece in pieces_of(BODY, 65536):
        buffer.append(piece)
    assert (buffer.size, budget.in_heap) == (len(BODY), len(BODY))
    assert buffer.take() == BODY
    assert (buffer.size, budget.in_heap) == (0, 0)


@pytest.mark.parametrize("declared", [len(BODY), None])
def test_past_the_heap_allowance_a_body_moves_into_its_own_mapping(declared: int | None) -> None:
    budget = BodyBudget(LIMIT)
    budget.in_heap = HEAP_BYTES_MAX - 100_000  # other bodies still arriving
    buffer = BodyBuffer(LIMIT, budget)
    buffer.begin(declared)
    pieces = pieces_of(BODY, 65536)
    buffer.append(pieces[0])  # fits the allowance
    assert budget.in_heap == HEAP_BYTES_MAX - 100_000 + 65536
    for piece in pieces[1:]:  # the second does not: the body leaves the heap
        buffer.append(piece)
    assert (buffer.size, budget.in_heap) == (len(BODY), HEAP_BYTES_MAX - 100_000)
    assert buffer.take() == BODY  # a chunked body's mapping grew past its first room
    assert (buffer.size, budget.in_heap) == (0, HEAP_BYTES_MAX - 100_000)


def test_a_dropped_body_gives_its_heap_bytes_back_and_the_buffer_serves_the_next() -> None:
    budget = BodyBudget(LIMIT)
    buffer = BodyBuffer(LIMIT, budget)
    buffer.begin(None)
    buffer.append(b"partial")
    buffer.begin(5)  # the next request's body; the partial one is dropped
    assert budget.in_heap == 0
    buffer.append(b"ab")
    buffer.append(b"cde")
    assert buffer.take() == b"abcde"
    buffer.clear()
    buffer.clear()
    assert (buffer.size, budget.in_heap) == (0, 0)
