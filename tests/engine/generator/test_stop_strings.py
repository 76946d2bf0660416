"""Stop-string scans (engine/generator/stop_strings.py) against a brute-force reference, the first n such that a
stop string lies in decode(tokens[:n]), on fake decoders: multi-character pieces, byte pieces that split
characters, and a decoder that drops a leading space at the start of a decode (as SentencePiece does); strings
that span token boundaries, feeds split anyhow, bounded decoding, validation.
Run: pytest tests/engine/generator/test_stop_strings.py
"""

import random

import pytest

from tailrace.engine.generator.stop_strings import MAX_HELD_TOKENS, StopStrings

PIECES = ["he", "llo", " wor", "ld", "!", "lo w", "o", " ", "x", "orl"]


def join_decode(pieces):
    return lambda ids: "".join(pieces[i] for i in ids)


def byte_decode(chunks):
    """A byte-level decoder: chunk bytes joined, then UTF-8 with replacement characters, as Hugging Face's."""
    return lambda ids: b"".join(chunks[i] for i in ids).decode("utf-8", errors="replace")


def reference(decode, strings, tokens):
    """The brute force: the first n whose text holds a stop string, else 0."""
    for n in range(1, len(tokens) + 1):
        if any(s in decode(tokens[:n]) for s in strings):
            return n
    return 0


def test_a_string_across_tokens_ends_at_the_completing_token():
    stops = StopStrings(["o w"], join_decode(PIECES))
    assert stops.scan().feed([0, 1, 2, 3]) == 3  # "he" "llo" " wor": "o w" spans "llo" and " wor"
    assert StopStrings(["wo"], join_decode(PIECES)).scan().feed([0, 1, 2, 3]) == 3  # ends inside " wor"
    assert StopStrings(["he"], join_decode(PIECES)).scan().feed([0, 1]) == 1  # within the first token
    assert StopStrings(["hello world!"], join_decode(PIECES)).scan().feed([0, 1, 2, 3, 4, 8]) == 5
    assert StopStrings(["low", "zz"], join_decode(PIECES)).scan().feed([0, 1, 2, 3]) == 0
    # Split feeds are one feed: the scan keeps the text a string could still be completing.
    scan = StopStrings(["o wo"], join_decode(PIECES)).scan()
    assert scan.feed([0]) == 0 and scan.feed([1]) == 0 and scan.feed([2, 4]) == 1 and scan.done
    with pytest.raises(AssertionError):
        scan.feed([4])


@pytest.mark.parametrize("seed", range(3))
def test_random_turns_equal_the_brute_force(seed):
    rng = random.Random(seed)
    decode = join_decode(PIECES)
    for _ in range(300):
        tokens = [rng.randrange(len(PIECES)) for _ in range(rng.randrange(1, 30))]
        text = decode(tokens)
        # Strings taken from the text itself (so they occur, often across boundaries), and some that may not.
        strings = [text[i:i + rng.randrange(1, 7)] for i in (rng.randrange(len(text)), rng.randrange(len(text)))]
        strings += rng.choice([[], ["ll"], ["dhe", "o!"]])
        expected = reference(decode, strings, tokens)
        scan, got, fed = StopStrings(strings, decode).scan(), 0, 0
        while fed < len(tokens) and not got:  # fed in random chunks, as speculative steps emit them
            chunk = tokens[fed:fed + rng.randrange(1, 6)]
            num = scan.feed(chunk)
            got, fed = (fed + num, fed) if num else (0, fed + len(chunk))
        assert got == expected, (tokens, strings)


def test_bytes_of_one_character_split_over_tokens():
    # Byte-level pieces: "é" is two tokens, "€" three. A string ends at the token that completes its last
    # character, never at one that holds half of it.
    pieces = [b"a", b"\xc3", b"\xa9", b"!", b"\xe2\x82", b"\xac", b" "]
    decode = byte_decode(pieces)
    tokens = [0, 1, 2, 3, 6, 4, 5, 0]  # "aé! €a"
    assert StopStrings(["é!"], decode).scan().feed(tokens) == 4
    assert StopStrings(["é"], decode).scan().feed(tokens) == 3
    assert StopStrings([" €"], decode).scan().feed(tokens) == 7
    assert StopStrings(["€a"], decode).scan().feed(tokens) == 8
    rng = random.Random(0)
    for _ in range(300):  # valid text cut into byte chunks anywhere: runs of tokens that all end mid-character
        text = "".join(rng.choice("aé€😀 !") for _ in range(rng.randrange(1, 30)))
        data, cuts = text.encode(), []
        i = 0
        while i < len(data):
            cuts.append(data[i:i + rng.randrange(1, 4)])
            i += len(cuts[-1])
        chunks = list(cuts)
        decode = byte_decode(chunks)
        tokens = list(range(len(chunks)))
        j = rng.randrange(len(text))
        strings = [text[j:j + rng.randrange(1, 4)]]
        assert StopStrings(strings, decode).scan().feed(tokens) == reference(decode, strings, tokens), (text, chunks)
    for _ in range(300):  # bytes that are no text at all: lone continuation and lead bytes among letters
        chunks = [bytes(rng.choice(b"ab \x80\x9f\xc3\xe2\xf0") for _ in range(rng.randrange(1, 4)))
                  for _ in range(rng.randrange(1, 30))]
        decode = byte_decode(chunks)
        tokens, strings = list(range(len(chunks))), ["".join(rng.choice("ab ") for _ in range(rng.randrange(1, 4)))]
        assert StopStrings(strings, decode).scan().feed(tokens) == reference(decode, strings, tokens), chunks


def test_a_decoder_that_drops_a_leading_space_sees_it_between_tokens():
    # SentencePiece-style: "▁" is a space, dropped at the start of a decode. Decoding each token alone would
    # give "thecat" and miss "e c"; the scan decodes a token with the tokens before it.
    pieces = ["▁the", "▁cat", "▁sat"]
    decode = lambda ids: "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")  # noqa: E731
    assert StopStrings(["e c"], decode).scan().feed([0, 1, 2]) == 2
    assert StopStrings(["thec"], decode).scan().feed([0, 1, 2]) == 0
    assert StopStrings(["the"], decode).scan().feed([0, 1, 2]) == 1


def test_decoding_stays_bounded():
    lengths = []

    def decode(ids):
        lengths.append(len(ids))
        return "".join(PIECES[i] for i in ids)

    scan = StopStrings(["zzz"], decode).scan()
    rng = random.Random(1)
    assert scan.feed([rng.randrange(len(PIECES)) for _ in range(2000)]) == 0
    assert max(lengths) <= 2 and len(scan.tail) == 2 and len(scan.ids) <= 1
    # Tokens without text (special tokens skipped) are held at most MAX_HELD_TOKENS, then let go.
    decode = lambda ids: "".join("" if i == 0 else "a" for i in ids)  # noqa: E731
    scan = StopStrings(["ab"], decode).scan()
    assert scan.feed([0] * 100) == 0 and len(scan.ids) <= 2 * MAX_HELD_TOKENS
    assert scan.feed([1]) == 0


@pytest.mark.parametrize("strings, match", [([], "empty"), ([""], "non-empty"), ("ab", "list of strings"),
                                            (["a"] * 17, "at most 16"), (["x" * 65], "at most 64"),
                                            ([3], "non-empty string")])
def test_bad_stop_strings_are_refused_by_name(strings, match):
    with pytest.raises(ValueError, match=f"env.stop_strings: .*{match}"):
        StopStrings(strings, join_decode(PIECES), name="env.stop_strings")
