"""A response's text as its tokens arrive (pure logic, no I/O): incremental detokenization that
never shows half a UTF-8 character, and stop strings (held back while they may be forming, cut
where they complete, with the tokens of a verified block after them dropped)."""

from __future__ import annotations

TEXT_TAIL, TEXT_STRIDE = 64, 256  # tokens a stream decodes again on every push; tokens between fixings


class TextStream:
    """Incremental detokenization with stop strings: `push(tokens)` returns the text that is safe
    to show (never half a UTF-8 character, never a possible prefix of a stop string)."""

    def __init__(self, tokenizer, stop: tuple[str, ...], shown: tuple[int, ...] = ()):
        self.tok, self.eos, self.stop = tokenizer, tokenizer.eos_ids, stop
        self.ids: list[int] = list(shown)  # tokens a resumed request's client has
        # ...but not all of their text: what the stream held back (half a character, what might
        # have become a stop string) was never sent, so it is sent now
        self.shown = self._held_end(self._decode(self.ids), 0) if shown else 0
        self.fixed, self.fixed_text, self.retry = 0, "", TEXT_TAIL + TEXT_STRIDE  # see _text
        self.stopped = False
        self.excess = 0  # tokens of the last push after the one that completed a stop string

    def _stop_at(self, text: str, final: bool = False) -> int:
        if not final:  # the U+FFFD of half a character is not text yet: no stop string matches it
            text = text.rstrip("\ufffd")
        return min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)

    def _held_end(self, text: str, shown: int) -> int:
        """Where the text that is safe to show ends (never before `shown`): before half a UTF-8
        character and before a tail that may still become a stop string."""
        end = len(text)
        while end > shown and text[end - 1] == "\ufffd":
            end -= 1
        for s in self.stop:
            for k in range(min(len(s) - 1, end - shown), 0, -1):
                if text[end - k:end] == s[:k]:
                    end -= k
                    break
        return end

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode([t for t in ids if t not in self.eos])

    def _text(self, n: int) -> str:
        """The text of the first n tokens. Decoding all of them on every push cost O(n) each, on
        the event loop (an 8k-token stream: ~14 s of CPU); so the text of all but the last
        TEXT_TAIL..TEXT_TAIL + TEXT_STRIDE tokens is fixed, once a whole decode shows the text
        splits there (whole characters before, the same text on both sides; or up to 3 tokens
        earlier, where the split would cut a character), and only the tokens after it are decoded
        again."""
        if n < self.fixed:
            return self._decode(self.ids[:n])
        if n < self.retry:
            return self.fixed_text + self._decode(self.ids[self.fixed:n])
        text = self._decode(self.ids[:n])
        for at in range(n - TEXT_TAIL, n - TEXT_TAIL - 4, -1):  # a character spans at most 4 byte tokens
            head = self._decode(self.ids[:at])
            if not head.endswith("\ufffd") and head + self._decode(self.ids[at:n]) == text:
                self.fixed, self.fixed_text = at, head
                break
        self.retry = n + TEXT_STRIDE
        return text

    def push(self, tokens: list[int], final: bool) -> str:
        self.ids.extend(tokens)
        text = self._text(len(self.ids))
        cut = self._stop_at(text, final)
        if cut >= 0:
            self.stopped, final, text = True, True, text[:cut]
            # a verified draft block brings several tokens at once: those after the one that
            # completed the stop string are not output (token_ids and usage say what one-by-one
            # decoding would have)
            first = len(self.ids) - len(tokens)
            for k in range(first, len(self.ids)):
                if self._stop_at(self._text(k)) >= 0:
                    self.excess = len(self.ids) - k
                    del self.ids[k:]
                    break
        end = len(text) if final else self._held_end(text, self.shown)
        delta, self.shown = text[self.shown:end], max(self.shown, end)
        return delta
