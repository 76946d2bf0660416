"""One layout per protocol version (protocol/SPEC.md, "Versions"). The wire layout of protocol/messages.py
(every structure's and message's fields in wire order with type, bounds and default, the error codes, the
dtypes) must equal the one recorded for PROTOCOL_VERSION in tests/protocol/layouts/, so a layout change
without a new version fails here; each version's changelog entry names what changed from the version
before; and the framing of Hello and Reject, which every version shares, is what every version had,
checked against frames that a version-1 and a version-2 peer really sent.

Run: pytest tests/protocol/test_versions.py
After raising PROTOCOL_VERSION and writing its changelog entry, record the new version's layout:
    python tests/protocol/test_versions.py --record
"""

import difflib
import re
import sys

import msgspec
from spec_doc import (
    LAYOUTS,
    layout_units,
    parse_frames,
    recorded_layouts,
    render_layout,
    section,
    spec_text,
    table_rows,
)
from wire_examples import V1_HELLO, V1_REJECT, V2_HELLO

from tailrace.protocol.codec import decode_any_version, encode_reject
from tailrace.protocol.messages import PROTOCOL_VERSION, ErrorCode, Hello, HelloPrefix, Reject

FROZEN_HELLO = [("role", "str"), ("name", "str"), ("protocol_version", "int"), ("package_version", "str")]
FROZEN_REJECT = [["0", "`code`", "int", "0..65535", "required"], ["1", "`text`", "str", "<= 4096 characters", "required"]]


def changelog(version: int) -> str:
    text = section(spec_text(), "Versions")
    match = re.search(rf"^### Version {version}\n(.*?)(?=^### |\Z)", text, re.S | re.M)
    assert match, f'SPEC.md, "Versions" has no "### Version {version}" entry'
    return match.group(1)


def test_layout_is_the_one_recorded_for_this_version():
    recorded = recorded_layouts()
    assert PROTOCOL_VERSION in recorded, ("no layout recorded for this version: write its changelog entry in "
                                          "SPEC.md, then python tests/protocol/test_versions.py --record")
    diff = "".join(difflib.unified_diff(recorded[PROTOCOL_VERSION].splitlines(True), render_layout().splitlines(True),
                                        f"layouts/v{PROTOCOL_VERSION}.txt", "protocol/messages.py"))
    assert not diff, (f"the wire layout changed, but PROTOCOL_VERSION is still {PROTOCOL_VERSION}: raise it, say what "
                      f"each role must change in SPEC.md's changelog, and record the new layout (--record)\n{diff}")


def test_no_layout_is_recorded_beyond_this_version():
    assert max(recorded_layouts()) == PROTOCOL_VERSION


def test_every_version_has_a_changelog_entry_naming_what_changed():
    assert re.findall(r"^### Version (\d+)$", section(spec_text(), "Versions"), re.M) == \
        [str(v) for v in range(PROTOCOL_VERSION, 0, -1)], "one entry per version, newest first"
    recorded = recorded_layouts()
    for version in range(2, PROTOCOL_VERSION + 1):
        if version - 1 not in recorded:
            continue
        old, new = layout_units(recorded[version - 1]), layout_units(recorded[version])
        changed = {name for name in old.keys() | new.keys() if old.get(name) != new.get(name)}
        entry = changelog(version)
        unnamed = sorted(name for name in changed if not re.search(rf"\b{re.escape(name)}\b", entry))
        assert not unnamed, f"SPEC.md's entry for version {version} does not name what changed: {unnamed}"


def test_changed_units_are_found():
    """The comparison the changelog test relies on sees a changed bound, an added code and a new message."""
    layout = render_layout()
    changed = layout.replace("| 1..4096 | required", "| 1..8192 | required", 1) \
        .replace("500 INTERNAL", "499 NEW_CODE\n500 INTERNAL").replace("### dtypes", "### 99 Brand\n\n### dtypes")
    old, new = layout_units(layout), layout_units(changed)
    assert {n for n in old.keys() | new.keys() if old.get(n) != new.get(n)} == {"WorkItem", "499", "Brand"}


def test_hello_and_reject_framing_is_frozen():
    """Hello is kind 1 and begins with the four fields of HelloPrefix; Reject is kind 3, [code, text]; 403
    is VERSION_MISMATCH. No version may change these (SPEC.md, "Versions")."""
    assert (Hello.KIND, Reject.KIND, ErrorCode.VERSION_MISMATCH) == (1, 3, 403)
    assert [(r[1].strip("`"), r[2]) for r in table_rows(HelloPrefix)] == FROZEN_HELLO
    assert [(r[1].strip("`"), r[2]) for r in table_rows(Hello)[:4]] == FROZEN_HELLO
    assert table_rows(Reject) == FROZEN_REJECT


def test_hellos_of_older_versions_are_read_by_the_frozen_framing():
    assert decode_any_version(V1_HELLO) == (1, HelloPrefix(role="reward", name="grader-1", protocol_version=1,
                                                           package_version="0.1.0"))
    assert decode_any_version(V2_HELLO) == (2, HelloPrefix(role="reward", name="grader-1", protocol_version=2,
                                                           package_version="1.0"))


def test_a_reject_in_another_version_is_what_that_version_encoded():
    reject = Reject(code=403, text="protocol version 1 not supported; this trainer speaks 4")
    assert encode_reject(reject, 1) == V1_REJECT
    assert decode_any_version(V1_REJECT) == (1, reject)
    assert msgspec.msgpack.decode(V1_REJECT[1]) == [403, reject.text]  # what any MessagePack library reads


def test_versions_section_bytes_are_those_frames():
    blocks = re.findall(r"```\n(frame 0.*?)```", section(spec_text(), "Versions"), re.S)
    assert [parse_frames(block) for block in blocks] == [V1_HELLO, V1_REJECT]


def record() -> None:
    path = LAYOUTS / f"v{PROTOCOL_VERSION}.txt"
    layout = render_layout()
    if path.exists() and path.read_text(encoding="utf-8") != layout:
        sys.exit(f"{path} records version {PROTOCOL_VERSION} as released; a changed layout is a new version: "
                 "raise PROTOCOL_VERSION in protocol/messages.py first")
    path.write_text(layout, encoding="utf-8")
    print(f"recorded {path}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        record()
    else:
        print(render_layout(), end="")
