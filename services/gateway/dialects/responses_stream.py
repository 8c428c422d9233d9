"""How a Responses stream is rendered: the engine's chat chunks as OpenAI's Responses events.

Feed every parsed chunk in order (`feed`), then `finish` once the engine's stream ended with
`[DONE]`. Together they give the sequence the OpenAI SDK and Codex parse, each event with
its `sequence_number`:

    response.created, response.in_progress
    per output item: response.output_item.added, then
      message:       response.content_part.added, response.output_text.delta*,
                     response.output_text.done, response.content_part.done
      reasoning:     response.content_part.added, response.reasoning_text.delta*,
                     response.reasoning_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta*,
                     response.function_call_arguments.done
      custom call:   response.custom_tool_call_input.delta*, .done
    response.output_item.done
    response.completed (or response.incomplete, cut by max_output_tokens)

An engine error event ends it with `response.failed`. The final response object is handed
to `on_done` (the dialect stores it for `previous_response_id`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from harnessrl.services.gateway.dialects.responses_output import (
    Echo,
    call_item,
    custom_input,
    finished,
    message_item,
    output_text,
    reasoning_item,
    usage,
)
from harnessrl.services.gateway.errors import engine_message


class ResponseStream:
    """Responses events for one engine chat-completion stream (choice 0)."""

    def __init__(self, echo: Echo, on_done: Callable[[dict[str, Any]], None], resp_id: str) -> None:
        self._echo = echo
        self._on_done = on_done
        self._seq = 0
        self._response: dict[str, Any] | None = None
        self._id = resp_id
        self._item: dict[str, Any] | None = None  # the output item being streamed
        self._text: list[str] = []  # its text (or arguments) so far
        self._tool_index: int | None = None  # the engine's index of the call being streamed
        self._finish: object = None
        self._prompt = 0
        self._completion = 0
        self._usage: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if self._response is None:
            self._start(chunk, out)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        if prompt := chunk.get("prompt_token_ids"):
            self._prompt = len(prompt)
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # a Responses request asks for one choice
            if ids := choice.get("token_ids"):
                self._completion += len(ids)
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self._stream_text("reasoning", reasoning, out)
            if delta.get("content"):
                self._stream_text("message", delta["content"], out)
            for call in delta.get("tool_calls") or ():
                self._stream_call(call, out)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return b"".join(out)

    def fail(self, error: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if self._response is None:
            self._start({}, out)
        assert self._response is not None
        self._response["status"] = "failed"
        self._response["error"] = {"code": "server_error", "message": engine_message(500, error)}
        self._event(out, "response.failed", response=self._response)
        return b"".join(out)

    def finish(self) -> bytes:
        out: list[bytes] = []
        if self._response is None:
            self._start({}, out)
        self._close(out)
        response = self._response
        assert response is not None
        prompt = int(self._usage.get("prompt_tokens", self._prompt))
        completion = int(self._usage.get("completion_tokens", self._completion))
        response["usage"] = usage(prompt, completion)
        finished(response, self._finish)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        self._event(out, kind, response=response)
        self._on_done(response)
        return b"".join(out)

    def _start(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        self._response = self._echo.response(self._id, int(chunk.get("created") or time.time()))
        self._event(out, "response.created", response=self._response)
        self._event(out, "response.in_progress", response=self._response)

    def _event(self, out: list[bytes], kind: str, **data: Any) -> None:
        payload = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        out.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n")

    @property
    def _index(self) -> int:
        assert self._response is not None
        return len(self._response["output"])

    def _stream_text(self, kind: str, text: str, out: list[bytes]) -> None:
        if self._item is None or self._item["type"] != kind:
            self._close(out)
            if kind == "message":
                item = message_item(self._id, "", "in_progress")
                item["content"], part = [], output_text("")
            else:
                item = reasoning_item(self._id, "")
                item["content"], part = [], {"type": "reasoning_text", "text": ""}
            self._open(item, out)
            ids = {"item_id": item["id"], "output_index": self._index, "content_index": 0}
            self._event(out, "response.content_part.added", **ids, part=part)
        assert self._item is not None
        self._text.append(text)
        ids = {"item_id": self._item["id"], "output_index": self._index, "content_index": 0}
        if kind == "message":
            self._event(out, "response.output_text.delta", **ids, delta=text, logprobs=[])
        else:
            self._event(out, "response.reasoning_text.delta", **ids, delta=text)

    def _stream_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        if self._tool_index != index or self._item is None:
            self._close(out)
            name = str(function.get("name") or "")
            item = call_item(
                self._echo,
                self._id,
                index,
                call_id=call.get("id"),
                name=name,
                arguments="",
                status="in_progress",
            )
            self._tool_index = index
            self._open(item, out)
        assert self._item is not None
        if arguments := function.get("arguments"):
            self._text.append(arguments)
            if self._item["type"] == "function_call":
                ids = {"item_id": self._item["id"], "output_index": self._index}
                self._event(out, "response.function_call_arguments.delta", **ids, delta=arguments)

    def _open(self, item: dict[str, Any], out: list[bytes]) -> None:
        self._item, self._text = item, []
        self._event(out, "response.output_item.added", output_index=self._index, item=item)

    def _close(self, out: list[bytes]) -> None:
        """End the item being streamed, if any, and add it to the output."""
        item, self._item = self._item, None
        if item is None:
            return
        text = "".join(self._text)
        ids = {"item_id": item["id"], "output_index": self._index}
        if item["type"] in ("message", "reasoning"):
            if item["type"] == "message":
                part = output_text(text)
                done = "response.output_text.done"
                self._event(out, done, **ids, content_index=0, text=text, logprobs=[])
                item["status"] = "completed"
            else:
                part = {"type": "reasoning_text", "text": text}
                self._event(out, "response.reasoning_text.done", **ids, content_index=0, text=text)
            self._event(out, "response.content_part.done", **ids, content_index=0, part=part)
            item["content"] = [part]
        elif item["type"] == "function_call":
            item["arguments"], item["status"] = text, "completed"
            done = "response.function_call_arguments.done"
            self._event(out, done, **ids, name=item["name"], arguments=text)
        else:  # custom_tool_call: its input is known whole only now
            item["input"], item["status"] = custom_input(text), "completed"
            self._event(out, "response.custom_tool_call_input.delta", **ids, delta=item["input"])
            self._event(out, "response.custom_tool_call_input.done", **ids, input=item["input"])
        self._event(out, "response.output_item.done", output_index=self._index, item=item)
        assert self._response is not None
        self._response["output"].append(item)
        self._tool_index = None
