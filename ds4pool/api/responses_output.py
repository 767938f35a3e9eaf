"""The Responses API renderer: the output processor's deltas → output items and the stream
events of POST /v1/responses (shapes as in the openai SDK's types/responses/).

One renderer per request. Streaming sends every event it returns; non-streaming feeds the
same deltas and sends `response` at the end, so both carry the same items.

Event order per item: response.output_item.added, then
  message:       content_part.added, output_text.delta..., output_text.done, content_part.done
  reasoning:     content_part.added, reasoning_text.delta..., reasoning_text.done,
                 content_part.done
  function_call: function_call_arguments.delta..., function_call_arguments.done
then response.output_item.done. A message or reasoning item stays open while its kind of
text continues; anything else closes it. Tool calls close on their ToolCallEnd.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ds4pool.output.deltas import (
    Delta,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from ds4pool.sched.request import Usage

Json = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    index: int  # output_index
    obj: Json  # the item as it appears in response.output (filled in as it goes)
    parts: list[str] = field(default_factory=list)  # text or arguments received so far


class ResponseRenderer:
    def __init__(
        self, response: Json, *, parallel_tool_calls: bool = True, keeps_kv: bool = True
    ) -> None:
        """`response`: the Response object's fixed fields (id, created_at, model, tools, ...);
        status, output, usage and the rest are filled in here. `keeps_kv`: the request has a
        session, so the prompt tokens it computed stay cached for the next turn."""
        self.response: Json = {
            **response,
            "object": "response",
            "status": "in_progress",
            "output": [],
            "usage": None,
            "error": None,
            "incomplete_details": None,
        }
        self._parallel = parallel_tool_calls
        self._keeps_kv = keeps_kv
        self._seq = 0
        self._open: _Item | None = None  # the message or reasoning item text goes to
        self._calls: dict[int, _Item] = {}  # open function calls by ToolCallStart.index
        self._skipped: set[int] = set()  # calls beyond the first when parallel is off
        self._num_calls = 0
        self._blank = ""  # whitespace-only text held back: it opens no message by itself
        self._reasoning = False  # the last delta was reasoning (for token attribution)
        self.reasoning_tokens = 0
        self.finish_reason: str | None = None

    def start(self) -> list[Json]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def feed(self, deltas: Iterable[Delta], num_tokens: int = 0) -> list[Json]:
        """Events for one chunk of deltas; `num_tokens` generated tokens made them (counted as
        reasoning tokens when the chunk was reasoning only)."""
        events: list[Json] = []
        kinds: set[type] = set()
        for delta in deltas:
            kinds.add(type(delta))
            events.extend(self._one(delta))
        produced = kinds - {Finish}
        if produced:  # a chunk that produced nothing (a held-back marker) continues the last
            self._reasoning = produced == {ReasoningDelta}
        if self._reasoning and produced <= {ReasoningDelta}:
            self.reasoning_tokens += num_tokens
        return events

    def complete(self, usage: Usage | None, error: str | None = None) -> list[Json]:
        """The closing event (response.completed / incomplete / failed), after Finish."""
        assert self.finish_reason is not None, "complete() before the Finish delta"
        r = self.response
        if usage is not None:
            r["usage"] = self.usage(usage)
        if error is not None or self.finish_reason == "error":
            r["status"] = "failed"
            r["error"] = {"code": "server_error", "message": error or "inference failed"}
            return [self._event("response.failed", response=self._snapshot())]
        if self.finish_reason == "length":
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
            return [self._event("response.incomplete", response=self._snapshot())]
        r["status"] = "cancelled" if self.finish_reason == "cancelled" else "completed"
        return [self._event("response.completed", response=self._snapshot())]

    def usage(self, u: Usage) -> Json:
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": u.cached_tokens,
                "cache_write_tokens": u.prompt_tokens - u.cached_tokens if self._keeps_kv else 0,
            },
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": min(self.reasoning_tokens, u.completion_tokens)
            },
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }

    # --- one delta ------------------------------------------------------------------------

    def _one(self, delta: Delta) -> list[Json]:
        if isinstance(delta, TextDelta):
            return self._text(delta.text)
        if isinstance(delta, ReasoningDelta):
            return self._reasoning_text(delta.text)
        if isinstance(delta, ToolCallStart):
            return self._call_start(delta)
        if isinstance(delta, ToolCallArgs):
            return self._call_args(delta)
        if isinstance(delta, ToolCallEnd):
            return self._call_end(delta.index, delta.arguments)
        assert isinstance(delta, Finish), delta
        return self._finish(delta)

    def _text(self, text: str) -> list[Json]:
        events: list[Json] = []
        if self._open is None or self._open.obj["type"] != "message":
            if not (self._blank + text).strip():
                self._blank += text
                return []
            text, self._blank = self._blank + text, ""
            events += self._close_open()
            events += self._open_item(
                {"type": "message", "id": new_id("msg"), "role": "assistant", "content": []},
                {"type": "output_text", "text": "", "annotations": []},
            )
        assert self._open is not None
        self._open.parts.append(text)
        return events + [self._part_event("response.output_text.delta", delta=text, logprobs=[])]

    def _reasoning_text(self, text: str) -> list[Json]:
        events: list[Json] = []
        if self._open is None or self._open.obj["type"] != "reasoning":
            events += self._close_open()
            events += self._open_item(
                {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []},
                {"type": "reasoning_text", "text": ""},
            )
        assert self._open is not None
        self._open.parts.append(text)
        return events + [self._part_event("response.reasoning_text.delta", delta=text)]

    def _call_start(self, delta: ToolCallStart) -> list[Json]:
        if not self._parallel and self._num_calls >= 1:
            self._skipped.add(delta.index)  # parallel_tool_calls=false: the first call only
            return []
        self._num_calls += 1
        events = self._close_open()
        call_id = delta.id if delta.id.startswith("call_") else f"call_{delta.id}"
        obj = {
            "type": "function_call",
            "id": "fc_" + call_id.removeprefix("call_"),
            "call_id": call_id,
            "name": delta.name,
            "arguments": "",
            "status": "in_progress",
        }
        item = self._add(obj)
        self._calls[delta.index] = item
        return events + [self._item_event("response.output_item.added", item)]

    def _call_args(self, delta: ToolCallArgs) -> list[Json]:
        item = self._calls.get(delta.index)
        if item is None:
            assert delta.index in self._skipped, f"arguments for unknown call {delta.index}"
            return []
        item.parts.append(delta.text)
        return [self._event("response.function_call_arguments.delta", item, delta=delta.text)]

    def _call_end(self, index: int, arguments: str, status: str = "completed") -> list[Json]:
        item = self._calls.pop(index, None)
        if item is None:
            assert index in self._skipped, f"end of unknown call {index}"
            return []
        item.obj["arguments"] = arguments
        item.obj["status"] = status
        return [
            self._event("response.function_call_arguments.done", item, arguments=arguments),
            self._item_event("response.output_item.done", item),
        ]

    def _finish(self, delta: Finish) -> list[Json]:
        self.finish_reason = delta.reason
        status = "incomplete" if delta.reason == "length" else "completed"
        events = self._close_open(status)
        for index in sorted(self._calls):  # a processor closes its calls; this is a guard
            item = self._calls[index]
            events += self._call_end(index, "".join(item.parts), "incomplete")
        return events

    # --- items ----------------------------------------------------------------------------

    def _add(self, obj: Json) -> _Item:
        obj.setdefault("status", "in_progress")
        self.response["output"].append(obj)
        return _Item(len(self.response["output"]) - 1, obj)

    def _open_item(self, obj: Json, part: Json) -> list[Json]:
        self._open = item = self._add(obj)
        return [
            self._item_event("response.output_item.added", item),
            self._part_event("response.content_part.added", part=copy.deepcopy(part)),
        ]

    def _close_open(self, status: str = "completed") -> list[Json]:
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(item.parts)
        if item.obj["type"] == "message":
            part: Json = {"type": "output_text", "text": text, "annotations": []}
            done = self._part_event("response.output_text.done", item, text=text, logprobs=[])
        else:
            part = {"type": "reasoning_text", "text": text}
            done = self._part_event("response.reasoning_text.done", item, text=text)
        item.obj["content"] = [part]
        item.obj["status"] = status
        return [
            done,
            self._part_event("response.content_part.done", item, part=copy.deepcopy(part)),
            self._item_event("response.output_item.done", item),
        ]

    # --- events ---------------------------------------------------------------------------

    def _event(self, kind: str, item: _Item | None = None, **fields: Any) -> Json:
        event: Json = {"type": kind, "sequence_number": self._seq}
        self._seq += 1
        if item is not None:
            event.update(item_id=item.obj["id"], output_index=item.index)
        event.update(fields)
        return event

    def _part_event(self, kind: str, item: _Item | None = None, **fields: Any) -> Json:
        item = item or self._open
        assert item is not None
        return self._event(kind, item, content_index=0, **fields)

    def _item_event(self, kind: str, item: _Item) -> Json:
        event = self._event(kind, item=None, output_index=item.index)
        event["item"] = copy.deepcopy(item.obj)
        return event

    def _snapshot(self) -> Json:
        return copy.deepcopy(self.response)
