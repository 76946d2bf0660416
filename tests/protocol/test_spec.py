"""protocol/SPEC.md cannot drift from the code: its message tables equal what protocol/messages.py declares
(kind codes, field names in wire order, types, bounds, defaults), its error codes equal ErrorCode, its
dtype table equals the codec's, and its worked example bytes are what our codec produces.

Run: pytest tests/protocol/test_spec.py
Regenerate the "Messages" section after changing messages.py: python tests/protocol/test_spec.py --write
"""

import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from tailrace.protocol.codec import decode, encode
from tailrace.protocol.messages import (
    PROTOCOL_VERSION,
    Credit,
    ErrorCode,
    Heartbeat,
    Hello,
    Score,
    ScoreRequest,
)
from tailrace.protocol.schema import (
    DTYPES,
    INT64_MAX,
    INT64_MIN,
    MESSAGE_CLASSES,
    STRUCT_CLASSES,
    Array,
    Scalar,
    hints,
    is_struct,
    split,
)

SPEC = Path(__file__).resolve().parents[2] / "protocol" / "SPEC.md"

WORKED_REQUEST = ScoreRequest(request_id=77, task="copy", prompt="copy: abc\n", completion="abc",
                              metadata={"answer": "abc"}, timeout_s=10.0)
WORKED_REPLY = Score(request_id=77, reward=1.0, details={"exact": 1.0})
REWARD_HELLO = Hello(role="reward", name="grader-1", protocol_version=PROTOCOL_VERSION, package_version="1.0", tasks=["math"],
                     max_inflight=4, capabilities={})


# ---------------------------------------------------------------------------------------- rendering


def describe_type(tp: Any) -> str:
    """The wire type of a field as written in protocol/SPEC.md's message tables, e.g. `int`,
    `array<int>`, `map<str, float>`, `tensor`, `SamplingParams`, `int | nil`."""
    if tp == Scalar:
        return "scalar"
    tp = split(tp)[0]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return " | ".join("nil" if a is type(None) else describe_type(a) for a in args)
    if origin is Literal:
        return "str"
    if tp is Array:
        return "tensor"
    if tp is bytes:
        return "bin"
    if tp in (int, float, str, bool):
        return tp.__name__
    if origin is list:
        return f"array<{describe_type(args[0])}>"
    if origin is dict:
        return f"map<{describe_type(args[0])}, {describe_type(args[1])}>"
    if is_struct(tp):
        return tp.__name__
    raise TypeError(f"no wire name for {tp!r}")


def describe_bounds(tp: Any) -> str:
    """The bounds of a field as written in protocol/SPEC.md's message tables. Every int, str, array and
    map must declare its bounds (msgspec checks them before it allocates): a missing one is an error."""
    if tp == Scalar:
        return ""
    base, bounds, spec = split(tp)
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin in (types.UnionType, typing.Union):
        return describe_bounds(next(a for a in args if a is not type(None)))
    if origin in (list, dict) or base in (int, str):
        missing = {"ge", "le"} - set(bounds) if base is int else {"max_length"} - set(bounds)
        assert not missing, f"{tp!r} declares no {missing}"
    if origin is list:
        inner = describe_bounds(args[0])
        count = f"<= {_num(bounds['max_length'])} elements"
        return f"{count}; each {inner}" if inner else count
    if origin is dict:
        assert describe_bounds(args[0]) == "<= 1024 characters", "map keys are str of at most 1024 code points"
        inner = describe_bounds(args[1])
        count = f"<= {_num(bounds['max_length'])} entries"
        return f"{count}; each value {inner}" if inner else count
    if base is int:
        return f"{_num(bounds['ge'])}..{_num(bounds['le'])}"
    if base is float:
        if "ge" not in bounds and "le" not in bounds:
            return ""
        lo = _num(bounds["ge"]) if "ge" in bounds else "-inf"
        hi = _num(bounds["le"]) if "le" in bounds else "inf"
        return f"{lo}..{hi}, not NaN"
    if origin is Literal:
        return "one of " + ", ".join(f'"{c}"' for c in args)
    if base in (str, bytes):
        return f"<= {_num(bounds['max_length'])} {'characters' if base is str else 'bytes'}"
    if base is Array:
        parts = [" or ".join(spec.dtypes) if spec and spec.dtypes else "any dtype"]
        if spec and spec.ndim is not None:
            parts.append(f"{spec.ndim}-d")
        if spec and spec.max_len is not None:
            parts.append(f"<= {_num(spec.max_len)} elements")
        return ", ".join(parts)
    return ""


def _num(x: float) -> str:
    if isinstance(x, float) and not x.is_integer():
        return repr(x)
    x = int(x)
    if x == INT64_MAX:
        return "2^63-1"
    if x == INT64_MIN:
        return "-2^63"
    if x >= 1 << 16 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"
    return str(x)


def wire_classes() -> list[type]:
    return [*STRUCT_CLASSES, *sorted(MESSAGE_CLASSES.values(), key=lambda c: c.KIND)]


def heading(cls: type) -> str:
    return f"### {cls.KIND} {cls.__name__}" if hasattr(cls, "KIND") else f"### {cls.__name__} (structure)"


def default_text(f: msgspec.structs.FieldInfo) -> str:
    if f.default_factory is not msgspec.NODEFAULT:
        value = f.default_factory()
        return f"{type(value).__name__} with its defaults" if isinstance(value, msgspec.Struct) else repr(value)
    if f.required:
        return "required"
    if f.default is None or isinstance(f.default, bool):
        return {None: "nil", True: "true", False: "false"}[f.default]
    return f'"{f.default}"' if isinstance(f.default, str) else repr(f.default)


def table_rows(cls: type) -> list[list[str]]:
    rows = []
    for i, f in enumerate(msgspec.structs.fields(cls)):
        tp = hints(cls)[f.name]
        bounds = describe_bounds(tp) or ("see its table" if is_struct(split(tp)[0]) else "any")
        rows.append([str(i), f"`{f.name}`", describe_type(tp), bounds, default_text(f)])
    return rows


CROSS_FIELD_CHECKS = {
    "Rollout": "Also required (else 401): `behaviour_logprobs` and `policy_versions` have as many elements as "
               "`completion_token_ids`, and `min_policy_version` <= `max_policy_version`.",
    "WeightsNotice": "Also required (else 401) when `transport` is \"broadcast\": `broadcast_store`, "
                     "`broadcast_group` and `broadcast_backend` are not empty, 1 <= `broadcast_rank` < "
                     "`broadcast_world_size`, `broadcast_bucket_bytes` >= 1 and `broadcast_timeout_s` > 0.",
}
"""What each class's __post_init__ checks, in words; every class with a __post_init__ needs an entry."""


def prose(cls: type) -> str:
    """The class docstring without its Example paragraph, as one paragraph of Markdown."""
    doc = inspect.cleandoc(cls.__doc__ or "").split("Example:")[0]
    return " ".join([*doc.split(), *CROSS_FIELD_CHECKS.get(cls.__name__, "").split()])


def render_messages_section() -> str:
    lines = [
        "## Messages",
        "",
        "Generated from protocol/messages.py by `python tests/protocol/test_spec.py --write`; "
        "tests/protocol/test_spec.py fails when this section and the code disagree. Each table lists a body's "
        "fields in wire order (`#` is the position in the body array). A body may omit trailing fields "
        "whose default is not `required`; the receiver then uses the default. Structures are encoded as "
        "arrays of their fields, exactly like a body. Bounds are inclusive.",
        "",
    ]
    for cls in wire_classes():
        lines += [heading(cls), "", prose(cls), "",
                  "| # | field | type | bounds | default |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table_rows(cls)]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- parsing


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"SPEC.md has no '## {title}' section"
    return match.group(1)


def parse_tables(text: str) -> dict[str, list[list[str]]]:
    """heading -> table rows (cells stripped), for every ### heading of a section."""
    tables: dict[str, list[list[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("### "):
            current = line.strip()
            tables[current] = []
        elif current and line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
            if cells[0] != "#":
                tables[current].append(cells)
    return tables


def parse_frames(text: str) -> list[bytes]:
    """Frames written as `frame N  hex hex ...` with continuation lines of hex in code blocks."""
    frames: list[bytearray] = []
    for line in text.splitlines():
        match = re.match(r"^frame (\d+)\s+((?:[0-9a-f]{2}\s*)+)$", line)
        if match:
            assert int(match.group(1)) == len(frames), line
            frames.append(bytearray.fromhex(match.group(2)))
        elif frames and re.match(r"^\s{6,}((?:[0-9a-f]{2}\s*)+)$", line):
            frames[-1] += bytes.fromhex(line)
        elif not line.startswith(" "):
            if frames and line.startswith("```"):
                break
    return [bytes(f) for f in frames]


# ---------------------------------------------------------------------------------------- tests


def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def test_spec_has_its_title_and_sections():
    text = spec_text()
    assert text.startswith(f"# tailrace wire protocol, version {PROTOCOL_VERSION}\n")
    for title in ("Frames", "Types", "Messages", "Error codes", "Worked example"):
        section(text, title)


def test_message_tables_match_messages_py():
    tables = parse_tables(section(spec_text(), "Messages"))
    expected = {heading(cls): table_rows(cls) for cls in wire_classes()}
    assert list(tables) == list(expected), "headings differ: run python tests/protocol/test_spec.py --write"
    for title, rows in expected.items():
        assert tables[title] == rows, f"{title}: table differs; run python tests/protocol/test_spec.py --write"


def test_every_cross_field_check_is_documented():
    with_checks = {cls.__name__ for cls in wire_classes() if hasattr(cls, "__post_init__")}
    assert with_checks == set(CROSS_FIELD_CHECKS)


def test_error_codes_match():
    rows = [r for r in parse_tables("### codes\n" + section(spec_text(), "Error codes"))["### codes"]
            if r and r[0].isdigit()]
    documented = {int(r[0]): r[1].strip("`") for r in rows}
    actual = {v: k for k, v in vars(ErrorCode).items() if not k.startswith("_")}
    assert documented == actual


def test_dtype_table_matches_codec():
    rows = parse_tables("### dtypes\n" + section(spec_text(), "Types"))["### dtypes"]
    documented = {r[0].strip("`"): int(r[1]) for r in rows if len(r) >= 2 and r[1].isdigit()}
    assert documented == DTYPES


def test_worked_example_bytes_are_what_the_codec_produces():
    text = section(spec_text(), "Worked example")
    request = section_between(text, "### Request", "### Reply")
    reply = text[text.index("### Reply"):]
    assert parse_frames(request) == encode(WORKED_REQUEST)
    assert parse_frames(reply) == encode(WORKED_REPLY)
    assert decode(parse_frames(request)) == WORKED_REQUEST
    # The byte-by-byte annotation tables cover each body exactly, in order.
    for part, msg in ((request, WORKED_REQUEST), (reply, WORKED_REPLY)):
        rows = [row for rows in parse_tables(part).values() for row in rows]
        annotated = b"".join(bytes.fromhex(row[0].strip("`")) for row in rows
                             if re.fullmatch(r"`[0-9a-f ]+`", row[0]))
        assert annotated == encode(msg)[1]


def test_reward_server_section_bytes_are_what_the_codec_produces():
    """The Hello omits its trailing default (incarnation) as the text says; the receiver fills it in."""
    text = section(spec_text(), "Reward servers")
    hello = parse_frames("\n".join(line.removeprefix("   ") for line in text.splitlines()))
    fields = [getattr(REWARD_HELLO, f) for f in REWARD_HELLO.__struct_fields__]
    assert fields[-1] == 0 and hello == [encode(REWARD_HELLO)[0], msgspec.msgpack.encode(fields[:-1])]
    assert decode(hello) == REWARD_HELLO
    said = re.search(r"(\d+) elements, .*?the trailing\s+`(\w+)` omitted", text, re.S)
    assert said and (int(said[1]), said[2]) == (len(fields) - 1, REWARD_HELLO.__struct_fields__[-1]), \
        "the text must say how many elements the example's body has and which trailing field it omits"
    inline = [[bytes.fromhex(h) for h in pair] for pair in
              re.findall(r"frame 0 `([0-9a-f ]+)`, frame 1 `([0-9a-f ]+)`|`(54 52 0[0-9a-f] 3f)` / `([0-9a-f ]+)`", text)
              for pair in [[x for x in pair if x]]]
    assert inline == [encode(Heartbeat(seq=3, wall_s=0.0)), encode(Credit(credits=32))]


def section_between(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end)]


def write_messages_section() -> None:
    text = spec_text()
    old = "## Messages\n" + section(text, "Messages")
    SPEC.write_text(text.replace(old, render_messages_section() + "\n"), encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_messages_section()
    else:
        print(render_messages_section())
