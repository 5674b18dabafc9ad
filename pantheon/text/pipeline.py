"""Per-choice text pipeline: token ids -> detok -> stop strings -> reasoning split -> tool calls.

Runs on the engine's device thread next to the decode loop (it is microseconds per token), so the
loop can act on what the text says — stop at a stop string, force the close of a think block when
the reasoning budget is spent — without a round trip to the asyncio side."""

from __future__ import annotations

from dataclasses import dataclass, field

from pantheon.text.detok import IncrementalDetokenizer
from pantheon.text.reasoning import ReasoningSplitter
from pantheon.text.stops import RepetitionDetector, StopMatcher


@dataclass
class TextDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # streaming delta.tool_calls[] entries
    stopped: bool = False  # a stop string matched: generation ends, nothing after it is emitted
    looping: bool = False  # the repetition detector tripped

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ChoiceText:
    tokenizer: object
    stops: list[str] = field(default_factory=list)
    think: bool = False  # parse <think>...</think> (think-style template)
    start_in_reasoning: bool = False  # the prompt ended inside an open think block
    tool_parser: object = None  # a ToolCallParser when the request offers tools
    # reasoning_format "none": the think block is followed (the budget can close it) but its text
    # stays in the content, which opens with `lead` (the think block's opening the prompt holds)
    keep_thoughts: bool = False
    lead: str = ""

    def __post_init__(self):
        self.detok = IncrementalDetokenizer(self.tokenizer, unparse_special=False)
        self.stop = StopMatcher(self.stops)
        self.split = ReasoningSplitter(start_in_reasoning=self.start_in_reasoning) if self.think else None
        self.loop = RepetitionDetector()
        self.tool_errors: list = []

    @property
    def in_reasoning(self) -> bool:
        return self.split is not None and self.split.in_reasoning

    @property
    def n_tool_calls(self) -> int:
        return len(self.tool_parser.calls) if self.tool_parser is not None else 0

    def push(self, token_id: int) -> TextDelta:
        delta = self.push_text(self.detok.push(token_id))
        delta.looping = self.loop.push(token_id)
        return delta

    def push_text(self, text: str) -> TextDelta:
        """Text that did not come from a sampled token (a grammar's closing text)."""
        text, stopped = self.stop.push(text)
        delta = self._split(text)
        delta.stopped = stopped
        if stopped and self.tool_parser is not None:  # generation ends here: a call cut off is reported
            events, self.tool_errors = self.tool_parser.finish()
            self._add_tool_events(delta, events)
        return delta

    def finish(self) -> TextDelta:
        """End of generation: release held-back text (not after a stop string matched)."""
        tail = self.detok.flush()
        text, stopped = self.stop.push(tail) if tail else ("", False)
        if not stopped:
            text += self.stop.flush()
        delta = self._split(text)
        if self.split is not None and not self.keep_thoughts:
            for kind, piece in self.split.flush():
                self._add(delta, kind, piece)
        if self.tool_parser is not None:
            events, self.tool_errors = self.tool_parser.finish()
            self._add_tool_events(delta, events)
        return delta

    def _split(self, text: str) -> TextDelta:
        delta = TextDelta()
        if self.split is None or self.keep_thoughts:
            if self.split is not None and text:
                self.split.push(text)  # its state only: where the think block is
            if text:
                text, self.lead = self.lead + text, ""
            self._add(delta, "content", text)
        elif text:
            for kind, piece in self.split.push(text):
                self._add(delta, kind, piece)
        return delta

    def _add(self, delta: TextDelta, kind: str, piece: str) -> None:
        if kind == "reasoning":
            delta.reasoning += piece
        elif self.tool_parser is None:
            delta.content += piece
        elif piece:
            self._add_tool_events(delta, self.tool_parser.push(piece))

    @staticmethod
    def _add_tool_events(delta: TextDelta, events) -> None:
        delta.content += events.content
        delta.tool_calls.extend(e.to_delta() for e in events.tool_events)
