"""protocol/SPEC.md cannot drift from the code: its message tables equal what protocol/messages.py declares
(kind codes, field names in wire order, types, bounds, defaults), its error codes equal ErrorCode, its
dtype table equals the codec's, every byte example is what our codec encodes its message to and decodes
back to it, those examples cover every message a reward server sends or receives, and every header written
in hex carries this protocol version. Versions and their layouts: tests/protocol/test_versions.py.

Run: pytest tests/protocol/test_spec.py
Regenerate the "Messages" section and the bytes of the "Byte examples" after changing messages.py or the
protocol version: python tests/protocol/test_spec.py --write
"""

import re
import sys

import msgspec
from spec_doc import (
    CROSS_FIELD_CHECKS,
    ROOT,
    SPEC,
    body_rows,
    byte_examples,
    bytes_cell,
    cells_cover,
    evaluate,
    heading,
    parse_frames,
    parse_tables,
    render_example,
    render_messages_section,
    section,
    spec_text,
    table_rows,
    wire_classes,
    write_examples,
)

from tailrace.protocol.codec import decode, encode
from tailrace.protocol.messages import (
    PROTOCOL_VERSION,
    Credit,
    EnvClose,
    EnvError,
    EnvObservation,
    EnvReset,
    EnvStep,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Reject,
    Score,
    ScoreError,
    ScoreRequest,
    Shutdown,
    Spans,
    Stats,
    Welcome,
)
from tailrace.protocol.schema import DTYPES

REWARD_HELLO = Hello(role="reward", name="grader-1", protocol_version=PROTOCOL_VERSION, package_version="1.0",
                     tasks=["math"], max_inflight=4, capabilities={})
REWARD_SERVER_SEES = {Hello, Welcome, Reject, Heartbeat, Credit, ScoreRequest, Score, ScoreError, Stats, Spans,
                      Error, Shutdown}
"""Every message a reward server sends or receives on its session (SPEC.md, "Reward servers")."""
ENV_SERVER_SEES = {Hello, Welcome, Reject, Heartbeat, Credit, EnvReset, EnvStep, EnvObservation, EnvError, EnvClose,
                   Error, Shutdown}
"""Every message an environment server sends or receives on its session (SPEC.md, "Environment servers")."""
SECTIONS = ("Versions", "Frames", "Types", "Messages", "Error codes", "Connections", "Handshake",
            "Heartbeats and liveness", "Flow control", "Authentication (CURVE)", "Size limits",
            "Work, leases and discards", "Reward servers", "Environment servers", "Weights by broadcast",
            "Stats and Spans", "Byte examples")


def test_spec_has_its_title_and_sections():
    text = spec_text()
    assert text.startswith(f"# tailrace wire protocol, version {PROTOCOL_VERSION}\n")
    assert re.findall(r"^## (.+)$", text, re.M) == list(SECTIONS)


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


def test_every_code_says_what_to_do():
    """The "What to do" table of Error codes says, for each code, what its receiver does: every code is
    there, none twice for one message, and exactly the codes a Reject and a ScoreError carry."""
    table = section(spec_text(), "Error codes").split("### What to do")[1]
    rows = [r for r in parse_tables("### what\n" + table)["### what"] if r[0] != "message"]
    said = [(r[0].strip("`"), int(code)) for r in rows for code in r[1].split(",")]
    assert len(said) == len(set(said)), "a code is listed twice for one message"
    assert {code for _, code in said} == {v for k, v in vars(ErrorCode).items() if not k.startswith("_")}
    assert {code for kind, code in said if kind == "Reject"} == {ErrorCode.VERSION_MISMATCH, ErrorCode.UNAUTHORIZED,
                                                                ErrorCode.INTERNAL}  # all the Server sends
    assert {code for kind, code in said if kind == "ScoreError"} == {
        ErrorCode.BAD_FIELD, ErrorCode.NO_CREDIT, ErrorCode.UNSUPPORTED, ErrorCode.INTERNAL, ErrorCode.TIMEOUT}
    assert {code for kind, code in said if kind == "EnvError"} == {
        ErrorCode.BAD_FIELD, ErrorCode.NO_CREDIT, ErrorCode.UNSUPPORTED, ErrorCode.INTERNAL, ErrorCode.TIMEOUT}
    assert {kind for kind, _ in said} == {"Reject", "Error", "ScoreError", "EnvError"}


def test_dtype_table_matches_codec():
    rows = parse_tables("### dtypes\n" + section(spec_text(), "Types"))["### dtypes"]
    documented = {r[0].strip("`"): int(r[1]) for r in rows if len(r) >= 2 and r[1].isdigit()}
    assert documented == DTYPES


def test_byte_examples_are_what_the_codec_produces():
    """Each example's frames are what our codec encodes its message to, and decode back to it; its table
    splits the body into rows whose bytes, joined, are the body."""
    examples = byte_examples(spec_text())
    assert examples
    for expr, generated in examples:
        msg = evaluate(expr)
        frames = parse_frames(generated)
        assert frames == encode(msg), f"{expr}: run python tests/protocol/test_spec.py --write"
        assert decode(frames) == msg, expr
        rows = parse_tables("### t\n" + generated)["### t"]
        assert cells_cover([r[0].strip("`") for r in rows if r[0] != "bytes"], frames[1]), expr
        assert generated == render_example(msg), f"{expr}: run python tests/protocol/test_spec.py --write"


def test_byte_examples_cover_every_message_a_reward_or_environment_server_sees():
    shown = {type(evaluate(expr)) for expr, _ in byte_examples(spec_text())}
    missing = sorted(cls.__name__ for cls in (REWARD_SERVER_SEES | ENV_SERVER_SEES) - shown)
    assert not missing, f"SPEC.md's Byte examples lack {missing}"
    headings = re.findall(r"^### (\d+) (\w+)", section(spec_text(), "Byte examples"), re.M)
    assert all(type(evaluate(expr)).__name__ == name and type(evaluate(expr)).KIND == int(kind)
               for (expr, _), (kind, name) in zip(byte_examples(spec_text()), headings, strict=True))


def test_body_rows_split_nested_bodies_exactly():
    """The table renderer against msgspec itself, on what the examples do not all have: arrays and maps of
    16 entries or more (array 16, map 16), empty ones, negative and large ints."""
    msg = Stats(role="reward", name="x" * 40, state="idle", policy_version=(1 << 63) - 1,
                counters={f"c{i}": -float(i) for i in range(17)}, wall_s=0.0)
    assert b"".join(data for data, _ in body_rows(msg)) == encode(msg)[1]
    err = Error(code=65535, text="", ref_kind=0)
    assert b"".join(data for data, _ in body_rows(err)) == msgspec.msgpack.encode(err)
    long = Reject(code=403, text="x" * 300)  # str 16, shown in part
    assert cells_cover([bytes_cell(data) for data, _ in body_rows(long)], encode(long)[1])
    assert not cells_cover([bytes_cell(data) for data, _ in body_rows(long)], encode(long)[1] + b"\x00")


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
    header = f"54 52 {PROTOCOL_VERSION:02x}"
    inline = [[bytes.fromhex(h) for h in pair] for pair in
              re.findall(rf"frame 0 `([0-9a-f ]+)`, frame 1 `([0-9a-f ]+)`|`({header} 3f)` / `([0-9a-f ]+)`", text)
              for pair in [[x for x in pair if x]]]
    assert inline == [encode(Heartbeat(seq=3, wall_s=0.0)), encode(Credit(credits=32))]


def test_every_header_in_hex_is_this_version():
    """Outside "Versions" (which shows an older peer's frames on purpose), a header written in hex carries
    PROTOCOL_VERSION: a version change cannot leave a stale example behind."""
    text = spec_text().replace("## Versions\n" + section(spec_text(), "Versions"), "")
    versions = {int(v, 16) for v in re.findall(r"\b54 52 ([0-9a-f]{2})\b", text)}
    assert versions == {PROTOCOL_VERSION}
    assert f"`0x{PROTOCOL_VERSION:02x}`" in section(text, "Frames")


def test_references_to_spec_sections_resolve():
    """Every `SPEC.md, "Title"` in the code and docs names a section (## Title) or a bold paragraph
    (**Title.**) of SPEC.md (a title may be shortened from its end: "Authentication")."""
    text = spec_text()
    titles = re.findall(r"^## (.+)$", text, re.M) + re.findall(r"\*\*([A-Z][^*]+?)\.\*\*", text)
    files = [p for folder in ("protocol", "engine", "tools", "examples", "docs") for p in (ROOT / folder).rglob("*")
             if p.suffix in (".py", ".md")] + [ROOT / "README.md"]
    refs = {(p.relative_to(ROOT).as_posix(), ref) for p in files
            for ref in re.findall(r'SPEC\.md, "([^"]+)"', p.read_text(encoding="utf-8"))}
    assert refs, "the search finds the references it checks"
    assert not [r for r in refs if not any(t.startswith(r[1]) for t in titles)]


def write() -> None:
    text = spec_text()
    text = text.replace("## Messages\n" + section(text, "Messages"), render_messages_section() + "\n")
    SPEC.write_text(write_examples(text), encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(render_messages_section())
