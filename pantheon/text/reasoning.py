"""Split streamed output into reasoning (`<think>…</think>`) and content; budget helpers.

ReasoningSplitter is a small state machine fed the text pieces that survive the stop matcher:

  start     -> nothing decided yet. Leading whitespace and a partial "<think>" are held. A complete
               "<think>" opens reasoning; anything else decides the default: reasoning when
               start_in_reasoning (the prompt already ended with an open "<think>"), else content.
               A redundant "<think>" at the start is dropped in both modes (some models repeat
               the tag the template already put in the prompt; vLLM does the same).
  reasoning -> text up to "</think>"; a suffix that may be the start of "</think>" is held so the
               tag is recognised when split across pieces, and so are trailing whitespace runs.
  content   -> everything else, verbatim. Tags are not parsed again: a "<think>" later in the
               output (or any "<think>" when the output did not start with one) is content.

Whitespace follows llama.cpp's parser (which strips reasoning_content and the content after
"</think>"): reasoning loses its leading and trailing whitespace, and content that follows
"</think>" loses its leading whitespace (it should not begin with "\n\n"). Holding back trailing
whitespace inside reasoning is what lets the stream strip it without knowing the future; it is
released as soon as a non-space character follows it.

ReasoningBudget counts tokens generated in reasoning and says once when "</think>" must be forced;
think_mode tells whether a chat template is think-style at all.
"""

from __future__ import annotations

_START, _REASONING, _CONTENT = 0, 1, 2


def _partial_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (tags are short)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, open_tag: str = "<think>", close_tag: str = "</think>",
                 start_in_reasoning: bool = False):
        if not open_tag or not close_tag:
            raise ValueError("open_tag and close_tag must be non-empty")
        self.open_tag, self.close_tag = open_tag, close_tag
        self.start_in_reasoning = start_in_reasoning
        self._state = _START
        self._held = ""
        self._lstrip = True  # strip leading whitespace of the next reasoning / post-close content
        self.reasoning_closed = False

    @property
    def in_reasoning(self) -> bool:
        """True while generated tokens count as reasoning (for the budget)."""
        if self._state == _START:
            # undecided: only whitespace / a partial open tag so far; a prompt-opened block is
            # reasoning already, and an open tag being typed is about to be
            return self.start_in_reasoning or bool(self._held.strip())
        return self._state == _REASONING

    def push(self, text: str) -> list[tuple[str, str]]:
        """Feed a piece; return [(kind, text)], kind "reasoning"/"content", same kinds merged."""
        out: list[tuple[str, str]] = []
        if text:
            self._feed(text, out)
        return out

    def flush(self) -> list[tuple[str, str]]:
        """End of generation: release what is held (a partial tag was text after all)."""
        out: list[tuple[str, str]] = []
        held, self._held = self._held, ""
        if self._state == _START:
            if self.start_in_reasoning:
                self._emit(out, "reasoning", held.strip())
            else:
                self._emit(out, "content", held)
        elif self._state == _REASONING:
            # an unclosed block ends here: strip its trailing whitespace like a closed one
            self._emit(out, "reasoning", held.rstrip())
        return out

    @staticmethod
    def _emit(out: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _feed(self, text: str, out: list[tuple[str, str]]) -> None:
        if self._state == _START:
            buf = self._held + text
            body = buf.lstrip()
            if not body or (self.open_tag.startswith(body) and len(body) < len(self.open_tag)):
                self._held = buf  # still undecided
                return
            self._held = ""
            if body.startswith(self.open_tag):
                self._state = _REASONING
                text = body[len(self.open_tag):]
            elif self.start_in_reasoning:
                self._state = _REASONING
                text = body
            else:
                self._state = _CONTENT
                self._lstrip = False  # no block was closed: content is verbatim
                self._emit(out, "content", buf)
                return
        if self._state == _REASONING:
            buf = self._held + text
            if self._lstrip:
                buf = buf.lstrip()
                self._lstrip = not buf
            idx = buf.find(self.close_tag)
            if idx < 0:
                keep = _partial_len(buf, self.close_tag)
                ready = buf[: len(buf) - keep]
                body = ready.rstrip()
                # hold the trailing whitespace (stripped if "</think>" follows) and a partial tag
                self._held = buf[len(body):]
                self._emit(out, "reasoning", body)
                return
            self._emit(out, "reasoning", buf[:idx].rstrip())
            self._held = ""
            self._state, self.reasoning_closed, self._lstrip = _CONTENT, True, True
            text = buf[idx + len(self.close_tag):]
        # content
        if self._lstrip:
            text = text.lstrip()
            self._lstrip = not text
        self._emit(out, "content", text)


class ReasoningBudget:
    """Counts reasoning tokens; tick() is True exactly once, on the budget_tokens-th one."""

    def __init__(self, budget_tokens: int | None):
        self.budget = budget_tokens if budget_tokens and budget_tokens > 0 else 0  # 0: disabled
        self.used = 0
        self.fired = False

    def tick(self, in_reasoning: bool) -> bool:
        """Call once per generated token; True means: inject the close tag now."""
        if not self.budget or self.fired or not in_reasoning:
            return False
        self.used += 1
        if self.used >= self.budget:
            self.fired = True
            return True
        return False


def think_mode(template_source: str | None) -> bool:
    """Whether a chat template is think-style (it mentions the "<think>" tag)."""
    return bool(template_source) and "<think>" in template_source
