"""Stop strings and loop detection for the decode stream (pure Python, per-token cost bounded).

StopMatcher sits between the detokenizer and the reasoning splitter. The client must never see any
part of a stop string, yet text is streamed piece by piece and a stop string may be split across
pieces. So after each push the matcher emits everything except the longest suffix of the pending
text that is a proper prefix of some stop string; that suffix is held until the next piece decides
it (it either completes a stop, or stops being a prefix and is emitted). Every stop occurrence must
therefore start inside held text or the new piece, so each push only searches
`held + new` (held is shorter than the longest stop): no rescans of the whole output.

When several stops occur, the one that *ends* first wins, ties going to the longer one (earliest
start). That is what a one-character-at-a-time stream would see, so the result does not depend on
how the text was chunked into pieces; for non-nested stops it is simply the earliest occurrence.

RepetitionDetector decides `finish_reason: "repetition_loop"` from the generated token ids alone.
Rule: the decode is looping once its most recent tokens are periodic with some period p in
1..max_period over a span long enough that normal text never produces it:
  * p == 1: one token repeated `single_run` (32) times in a row;
  * p >= 2: a span of at least max(`min_span`, `min_repeats` * p) tokens, i.e. >= 64 tokens and
    >= 6 full repeats of the block (p=2 needs 32 repeats, p=10 needs 6.4, p=64 needs 384 tokens).
For each p it keeps run[p] = how many consecutive latest positions i satisfy tok[i] == tok[i-p];
the last run[p] + p tokens are then periodic with period p. Updating every run[p] is one comparison
each, so a push costs O(max_period) and memory is O(max_period). Known limit: legitimately
periodic output of that length (e.g. a flat list of 32+ zeros, "0, 0, ...") also trips it; the
thresholds are constructor arguments for that reason. Feed it generated tokens only, not the prompt.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stops: Iterable[str] | None):
        # empty strings would match everywhere; duplicates only cost time
        self.stops: list[str] = sorted({s for s in (stops or ()) if s}, key=len)
        self._max_len = max((len(s) for s in self.stops), default=0)
        # stops grouped by first character: held-back candidates must start with one of these
        self._by_first: dict[str, list[str]] = {}
        for s in self.stops:
            self._by_first.setdefault(s[0], []).append(s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def push(self, text: str) -> tuple[str, bool]:
        """Feed a text piece; return (text safe to emit now, stopped)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        window = self._held + text
        best = None  # (end, start, stop)
        for s in self.stops:
            i = window.find(s)
            if i >= 0:
                key = (i + len(s), i, s)
                # earliest end wins; on equal end the earliest start (longer stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is not None:
            self.stopped, self.matched, self._held = True, best[2], ""
            return window[: best[1]], True
        keep = self._partial_len(window)
        self._held = window[len(window) - keep:] if keep else ""
        return window[: len(window) - keep], False

    def _partial_len(self, window: str) -> int:
        """Length of the longest suffix of window that is a proper prefix of some stop."""
        n = len(window)
        # scan left to right so the first hit is the longest suffix; a full stop cannot be here
        # (push found none), so only the last max_len - 1 characters can start a partial match
        for i in range(max(0, n - self._max_len + 1), n):
            cands = self._by_first.get(window[i])
            if cands:
                tail = window[i:]
                for s in cands:
                    if s.startswith(tail):
                        return n - i
        return 0

    def flush(self) -> str:
        """End of generation without a stop: the held-back text is ordinary output after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class RepetitionDetector:
    def __init__(self, max_period: int = 64, single_run: int = 32, min_span: int = 64,
                 min_repeats: int = 6):
        if max_period < 1:
            raise ValueError("max_period must be >= 1")
        self.max_period = max_period
        # need[p] = periodic span (tokens) that counts as a loop for period p; index 0 unused
        self._need = [0, single_run] + [max(min_span, min_repeats * p)
                                        for p in range(2, max_period + 1)]
        self._run = [0] * (max_period + 1)
        self._hist: list[int] = []
        self.looping = False
        self.period: int | None = None  # the period that tripped, for logs

    def push(self, token_id: int) -> bool:
        """Feed one generated token; True once (and from then on) the decode is looping."""
        if self.looping:
            return True
        hist, run, need = self._hist, self._run, self._need
        n = len(hist)
        for p in range(1, min(n, self.max_period) + 1):
            if hist[n - p] == token_id:
                r = run[p] + 1
                run[p] = r
                # the last r + p tokens (this one included) repeat with period p; latched
                if r + p >= need[p]:
                    self.looping, self.period = True, p
                    return True
            else:
                run[p] = 0
        hist.append(token_id)
        # only the last max_period tokens are ever compared; trim in batches (amortized O(1))
        if len(hist) > 4 * self.max_period:
            del hist[: len(hist) - self.max_period]
        return self.looping

    def reset(self) -> None:
        self._run = [0] * (self.max_period + 1)
        self._hist.clear()
        self.looping, self.period = False, None
