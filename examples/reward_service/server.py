"""A custom reward server for harnessrl: copy this file and replace `score()`.

It implements the `Reward` gRPC service (protos/harnessrl/v1/reward.proto). The harnessrl
reward service calls `Score` once per finished episode attempt and publishes the answer as
the episode's reward. The example reward judges the harness's answer against the task's
expected one, as text (a keyword-overlap judge for question-answer tasks) or as a number
(the calculator example's tasks, `"match": "numeric"`):

    result_json         {"answer": "Paris, the French capital"}          (the harness wrote it)
    task_metadata_json  {"answer": "Paris", "keywords": ["paris", "capital"]}  (the task's)

    result_json         {"answer": "47 times 38 is 1786.", "tools": 1}
    task_metadata_json  {"answer": "1786", "match": "numeric"}

As text, value is 1.0 when the normalised answer equals the expected one, else 0.5 times the
fraction of keywords present in the answer. As a number, value is 1.0 when the last number
the answer states equals the expected one (within NUMERIC_TOLERANCE), else 0. An answer
longer than MAX_ANSWER_CHARS scores 0 with the flag "answer_too_long", so stuffing every
keyword (or every number) into the answer does not pay.

The contract a reward server keeps (see reward.proto):
- deterministic: the same episode always gets the same response, as the caller may retry;
- a finite value;
- UNAVAILABLE for transient failures (the caller retries), any other error status for a
  request that cannot be scored (the reward is then missing, with the status message).

    python examples/reward_service/server.py --port 50061 [--host 127.0.0.1]

Logs `listening on <host>:<port>` to stderr once serving (port 0 picks a free port, and the
line names it), writes nothing to stdout, and stops gracefully on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import signal
import unicodedata
from typing import Any, NoReturn

import grpc

from harnessrl.v1 import events_pb2, reward_pb2, reward_pb2_grpc

MAX_ANSWER_CHARS = 1000
"""Longest answer that can score; a longer one scores 0 with the flag "answer_too_long"."""
NUMERIC_TOLERANCE = 1e-6
"""Largest difference (absolute, or relative to the expected number) a numeric answer may
have and still score 1."""
STOP_GRACE_S = 5.0
"""On SIGTERM or SIGINT, how long calls in progress get to finish before they are cancelled."""
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # as examples/calculator/reward.py reads one

log = logging.getLogger("reward_service")


class BadRequest(ValueError):
    """A request field that cannot be read; answered INVALID_ARGUMENT ("<field>: <reason>")."""


# --- the reward: replace from here ------------------------------------------------------------


def score(episode: events_pb2.EpisodeFinished) -> reward_pb2.ScoreResponse:
    """Score one finished episode attempt; pure and deterministic.

    Raises BadRequest when the task metadata is malformed (that is the task's fault, not
    the harness's, so the reward is missing rather than 0). A result that is empty, not
    JSON or has no answer is the harness's fault: it scores 0 with the flag "no_answer".
    """
    if episode.status != events_pb2.EPISODE_STATUS_SUCCEEDED:
        status = events_pb2.EpisodeStatus.Name(episode.status)
        return _zero(message=f"episode {status}: {episode.reason or 'no reason given'}")
    expected, keywords, numeric = _task(episode.task_metadata_json)
    answer = _answer(episode.result_json)
    if answer is None:
        return _zero(flag="no_answer", message="the result has no answer")
    if len(answer) > MAX_ANSWER_CHARS:
        return _zero(
            flag="answer_too_long",
            message=f"answer is {len(answer)} characters, over the limit of {MAX_ANSWER_CHARS}",
        )
    if numeric:
        return _score_number(answer, float(expected))
    words = f" {_normalise(answer)} "
    exact = words.strip() == _normalise(expected)
    found = sum(f" {keyword} " in words for keyword in keywords)
    fraction = found / len(keywords) if keywords else 0.0
    return reward_pb2.ScoreResponse(
        value=1.0 if exact else 0.5 * fraction,
        components={"exact": float(exact), "keywords": fraction},
        message=f"exact={exact} keywords={found}/{len(keywords)}",
    )


def _score_number(answer: str, expected: float) -> reward_pb2.ScoreResponse:
    """1.0 when the last number `answer` states ("1,786" reads as 1786) is `expected`."""
    found = _NUMBER.findall(answer.replace(",", ""))
    if not found:
        return _zero(flag="no_number", message="the answer states no number")
    stated = float(found[-1])
    right = math.isclose(stated, expected, rel_tol=NUMERIC_TOLERANCE, abs_tol=NUMERIC_TOLERANCE)
    return reward_pb2.ScoreResponse(
        value=float(right),
        components={"exact": float(right), "keywords": 0.0},
        message=f"stated {found[-1]}, expected {expected:g}",
    )


def _task(metadata_json: str) -> tuple[str, list[str], bool]:
    """The expected answer, the distinct normalised keywords, and whether the answer is
    judged as a number ("match": "numeric"; else "text", the default), from the task
    metadata."""
    metadata = _json_object(metadata_json, "task_metadata_json")
    expected = metadata.get("answer")
    if not _is_text(expected) or not _normalise(str(expected)):
        raise BadRequest('task_metadata_json: "answer" must be a non-empty string or a number')
    match = metadata.get("match", "text")
    if match not in ("text", "numeric"):
        raise BadRequest(f'task_metadata_json: "match" must be "text" or "numeric", not {match!r}')
    if match == "numeric" and not _is_number(expected):
        raise BadRequest(f'task_metadata_json: "answer" {expected!r} is not a number')
    keywords = metadata.get("keywords", [])
    if not isinstance(keywords, list) or not all(isinstance(k, str) for k in keywords):
        raise BadRequest('task_metadata_json: "keywords" must be a list of strings')
    normalised = (_normalise(k) for k in keywords)
    return str(expected), list(dict.fromkeys(k for k in normalised if k)), match == "numeric"


def _answer(result_json: str) -> str | None:
    """The harness's answer: the result's "answer", or a bare string or number result."""
    try:
        result = json.loads(result_json)
    except ValueError:
        return None
    if isinstance(result, dict):
        result = result.get("answer")
    if not _is_text(result) or not _normalise(str(result)):
        return None
    return str(result)


def _normalise(text: str) -> str:
    """Case-folded words without punctuation, joined by single spaces."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(re.sub(r"[^\w\s]", " ", text).split())


def _is_text(value: object) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if not _is_text(value):
        return False
    try:
        return math.isfinite(float(str(value)))
    except ValueError:
        return False


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise BadRequest(f"{field}: not JSON ({err})") from err
    if not isinstance(value, dict):
        raise BadRequest(f"{field}: must be a JSON object, got {type(value).__name__}")
    return value


def _zero(message: str, flag: str | None = None) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(
        value=0.0,
        components={"exact": 0.0, "keywords": 0.0},
        flags=[flag] if flag else [],
        message=message,
    )


# --- the reward: replace up to here -----------------------------------------------------------


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Answers Score with `score()`; a BadRequest becomes INVALID_ARGUMENT.

    Any other exception becomes UNKNOWN (grpc's default): the reward is then missing. Return
    UNAVAILABLE (`context.abort(grpc.StatusCode.UNAVAILABLE, ...)`) instead for failures a
    retry can fix, such as a judge model that is briefly overloaded.
    """

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: Any
    ) -> reward_pb2.ScoreResponse:
        try:
            return score(request.episode)
        except BadRequest as err:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))


async def _abort(context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the call with `code` (grpc.aio's abort raises; this says so to the type checker)."""
    await context.abort(code, details)
    raise AssertionError("unreachable: ServicerContext.abort raises")


async def serve(host: str, port: int) -> None:
    """Serve until SIGTERM or SIGINT, then give calls in progress STOP_GRACE_S to finish."""
    server = grpc.aio.server()
    reward_pb2_grpc.add_RewardServicer_to_server(RewardServicer(), server)
    bound = server.add_insecure_port(_address(host, port))
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    log.info("listening on %s", _address(host, bound))
    try:
        await stopping.wait()
        log.info("stopping")
    finally:
        await server.stop(STOP_GRACE_S)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description="Example harnessrl Reward gRPC server.")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, required=True, help="port to bind; 0 picks a free one")
    args = parser.parse_args()
    # stderr (logging's default stream) and one plain line per record: the first line is
    # `listening on <host>:<port>`, which scripts may parse.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
