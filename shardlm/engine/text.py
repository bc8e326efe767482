"""Streaming text with stop strings: token ids in, text deltas out, cut before a stop string.

Like vLLM and OpenAI, a stop string ends the completion and is not part of it. While
streaming, the last ``len(longest stop) - 1`` characters are held back, since they may
be the start of a stop string that the next token completes; so no emitted text is
ever taken back, and the concatenated deltas equal the non-streamed text.
"""

from __future__ import annotations

from shardlm.models.tokenizer import IncrementalDecoder


class StopText:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` already handed out
        self.stopped: str | None = None  # the stop string found: the completion ends at ``sent``

    def push(self, token_ids: list[int]) -> str:
        """Text that is safe to emit after these tokens ('' while it may be part of a stop string)."""
        self.text += self.decoder.push(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The rest, once the engine has finished the sequence."""
        self.text += self.decoder.flush()
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stopped:
            return ""
        # a stop cannot begin before `sent`: it would have been whole in the text we checked then
        found = [(i, s) for i, s in ((self.text.find(s, self.sent), s) for s in self.stops) if i >= 0]
        if found:
            end, self.stopped = min(found)
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], end
        return out
