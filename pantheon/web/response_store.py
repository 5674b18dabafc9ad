"""Kept Responses (`store: true`): each one's conversation (as chat turns, its own output included)
so that `previous_response_id` continues it, and the response object for GET /v1/responses/{id}.
Bounded by count and by the text it holds; the least recently used go first. A chain's turns are
shared between its responses (each holds the list of its predecessor's turns plus its own), so a
long conversation costs its text once, not once per turn."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1024
MAX_TEXT_BYTES = 64 << 20


@dataclass
class Kept:
    messages: list[dict]  # the conversation through this response's output, without instructions
    response: dict  # the response object as returned
    session_id: str | None  # the KV session its continuations resume
    own_bytes: int  # the text this response added (what evicting it frees, roughly)


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_TEXT_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, response_id: str) -> Kept | None:
        with self._lock:
            kept = self._kept.get(response_id)
            if kept is not None:
                self._kept.move_to_end(response_id)
            return kept

    def put(self, response_id: str, kept: Kept) -> None:
        with self._lock:
            self._kept[response_id] = kept
            self._bytes += kept.own_bytes
            while self._kept and (len(self._kept) > self.max_responses or self._bytes > self.max_bytes):
                _, old = self._kept.popitem(last=False)
                self._bytes -= old.own_bytes

    def delete(self, response_id: str) -> bool:
        with self._lock:
            kept = self._kept.pop(response_id, None)
            if kept is not None:
                self._bytes -= kept.own_bytes
            return kept is not None

    def __len__(self) -> int:
        return len(self._kept)
