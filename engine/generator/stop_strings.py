"""Stop strings: an assistant turn ends at the token whose decoded text completes one of a set of strings
(vLLM's `stop`, but the completing token stays in the completion: it was sampled, and is trained on).

    StopStrings(strings, decode)   validated once per generator; decode(ids) -> text (special tokens skipped,
                                   as the environment receives a turn's text)
    .scan() -> StopScan            one per assistant turn, fed the turn's tokens in order
    StopScan.feed(tokens) -> n     the number of these tokens up to and including the one that completes a
                                   stop string (the scan ends there), or 0 when none does

Detection is incremental and bounded, as vLLM's detokenize_incrementally: the text a token adds is
decode(context + held + token) minus decode(context), where context is the few tokens decoded last time (so
a tokenizer that drops a word's leading space at the start of a decode, or merges bytes into one character,
still adds the right text); a token whose text ends in an incomplete character is held until the character
completes (at most MAX_HELD_TOKENS), the complete text before that character searched at once. Only the
turn's last max(len(s)) - 1 characters are kept, enough to find a string that spans token boundaries: a step
decodes a handful of tokens per row, never the whole turn.
Test: pytest tests/engine/generator/test_stop_strings.py
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tailrace.engine.config import check_stop_strings

MAX_HELD_TOKENS = 8  # tokens held back for an incomplete character before their text is taken as it is
REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of a character not complete yet


class StopStrings:
    """A validated set of stop strings and the decoder their scans use (see the module docstring)."""

    def __init__(self, strings: Sequence[str], decode: Callable[[list[int]], str], *, name: str = "stop strings"):
        check_stop_strings(strings, name)
        if not strings:
            raise ValueError(f"{name}: empty (give no StopStrings at all instead)")
        self.strings = tuple(dict.fromkeys(strings))
        self.decode = decode
        self.keep_chars = max(len(s) for s in self.strings) - 1  # a string not complete yet lies within these

    def scan(self) -> StopScan:
        """A scan of a new assistant turn (no text yet)."""
        return StopScan(self)

    def __repr__(self) -> str:
        return f"StopStrings({list(self.strings)!r})"


class StopScan:
    """The stop-string state of one assistant turn: the tokens decoded last (context), the tokens held back
    (their text incomplete), and the turn's last characters."""

    __slots__ = ("stops", "ids", "num_context", "num_untaken", "tail", "done")

    def __init__(self, stops: StopStrings):
        self.stops = stops
        self.ids: list[int] = []  # context tokens, then held tokens
        self.num_context = 0
        self.num_untaken = 0  # characters at the end of the context's text not taken yet (0 or 1)
        self.tail = ""  # the turn's text so far, its last stops.keep_chars characters
        self.done = False  # a stop string was completed: the turn is over

    def feed(self, tokens: Sequence[int]) -> int:
        """Scan these next tokens of the turn: the count up to and including the one whose text completes a
        stop string, or 0 when none does (then every token was scanned). Tokens after a completing one are
        not scanned: they are not emitted."""
        assert not self.done, "the turn already ended at a stop string"
        for n, token in enumerate(tokens, start=1):
            if self._add(int(token)):
                self.done = True
                return n
        return 0

    def _add(self, token: int) -> bool:
        self.ids.append(token)
        decode = self.stops.decode
        # The context's text as it was taken (less the incomplete character it ended in, when it was let go).
        taken = len(decode(self.ids[:self.num_context])) - self.num_untaken if self.num_context else 0
        new = decode(self.ids)[taken:]
        if (not new or new.endswith(REPLACEMENT)) and len(self.ids) - self.num_context < MAX_HELD_TOKENS:
            # The text ends in an incomplete character: hold these tokens, but what is complete may end a string.
            return self._finds(new.rstrip(REPLACEMENT))
        self.num_untaken = int(new.endswith(REPLACEMENT))  # held too long: taken without the incomplete character
        new = new[:len(new) - self.num_untaken]
        del self.ids[:self.num_context]  # the tokens just decoded are the next context
        self.num_context = len(self.ids)
        hit = self._finds(new)
        keep = self.stops.keep_chars
        self.tail = (self.tail + new)[-keep:] if keep else ""
        return hit

    def _finds(self, new: str) -> bool:
        """Whether a stop string ends in `new`, the text after the tail (one within the tail would have ended the
        turn before)."""
        window = self.tail + new
        return any(window.find(s, max(0, len(self.tail) - len(s) + 1)) >= 0 for s in self.stops.strings)
