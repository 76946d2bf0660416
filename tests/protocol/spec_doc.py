"""protocol/SPEC.md as data: its sections, tables and hex frames parsed, and the parts generated from the
code rendered — the message tables (from protocol/messages.py), the byte examples (from our codec) and the
layout recorded per protocol version. Shared by tests/protocol/test_spec.py and test_versions.py.

Regenerate SPEC.md's "Messages" section and the bytes of its "Byte examples" after a change to
messages.py: python tests/protocol/test_spec.py --write
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec

from tailrace.protocol.codec import encode
from tailrace.protocol.messages import ErrorCode
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

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "protocol" / "SPEC.md"
LAYOUTS = Path(__file__).resolve().parent / "layouts"


def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


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
    "EnvObservation": "Also required (else 401): `reward` is nil or finite.",
    "Rollout": "Also required (else 401): `behaviour_logprobs` and `policy_versions` (and `loss_mask`, when not "
               "nil) have as many elements as `completion_token_ids`, and `min_policy_version` <= "
               "`max_policy_version`.",
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



# ---------------------------------------------------------------------------------------- byte examples

CONSTRUCTOR = re.compile(r"^`(\w+\(.*\))`$", re.M)
GENERATED = re.compile(r"```\n(?:.*\n)*?```\n\n(?:\|.*\n)+")
"""A byte example in SPEC.md is a "### " block of its "Byte examples" section: the message on a line of its
own in backticks, a blank line, the generated part (its frames in a code block, a blank line, the table of
its body), then any prose."""

WIRE_NAMES = {cls.__name__: cls for cls in [*MESSAGE_CLASSES.values(), *STRUCT_CLASSES]}


def evaluate(expr: str, names: dict[str, type] | None = None) -> Any:
    """A message written as SPEC.md writes it, e.g. `Score(request_id=77, reward=1.0)`: literals and wire
    classes called with keywords, nothing else."""
    names = WIRE_NAMES if names is None else names

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {value(k): value(v) for k, v in zip(node.keys, node.values, strict=True)}
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names and not node.args:
            return names[node.func.id](**{k.arg: value(k.value) for k in node.keywords})
        raise ValueError(f"{expr}: {ast.unparse(node)} is not a literal or a wire class")

    return value(ast.parse(expr, mode="eval").body)


def _plural(n: int, unit: str) -> str:
    return f"{n} {unit}" if n == 1 else f"{n} {unit[:-1]}ies" if unit.endswith("y") else f"{n} {unit}s"


def msgpack_format(data: bytes) -> str:
    """The MessagePack format of the object `data` starts with, named as the MessagePack spec names it."""
    b = data[0]
    if b <= 0x7F:
        return "positive fixint"
    if b >= 0xE0:
        return "negative fixint"
    for top, name, unit in ((0x8F, "fixmap", "entry"), (0x9F, "fixarray", "element"), (0xBF, "fixstr", "byte")):
        if b <= top:
            return f"{name}, {_plural(b & (0x1F if name == 'fixstr' else 0x0F), unit)}"
    fixed = {0xC0: "nil", 0xC2: "false", 0xC3: "true", 0xCA: "float 32", 0xCB: "float 64", 0xCC: "uint 8",
             0xCD: "uint 16", 0xCE: "uint 32", 0xCF: "uint 64", 0xD0: "int 8", 0xD1: "int 16", 0xD2: "int 32",
             0xD3: "int 64"}
    if b in fixed:
        return fixed[b]
    name, size, unit = {0xC4: ("bin 8", 1, "byte"), 0xC5: ("bin 16", 2, "byte"), 0xC6: ("bin 32", 4, "byte"),
                        0xD9: ("str 8", 1, "byte"), 0xDA: ("str 16", 2, "byte"), 0xDB: ("str 32", 4, "byte"),
                        0xDC: ("array 16", 2, "element"), 0xDD: ("array 32", 4, "element"),
                        0xDE: ("map 16", 2, "entry"), 0xDF: ("map 32", 4, "entry")}[b]
    return f"{name}, {_plural(int.from_bytes(data[1:1 + size], 'big'), unit)}"


def _container(n: int, fix: int, b16: int, b32: int) -> bytes:
    if n < 16:
        return bytes((fix | n,))
    return bytes((b16,)) + n.to_bytes(2, "big") if n < 1 << 16 else bytes((b32,)) + n.to_bytes(4, "big")


def _literal(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "nil", True: "true", False: "false"}[value]
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str | list | dict) else repr(value)


def body_rows(value: Any, path: str = "") -> list[tuple[bytes, str]]:
    """(bytes, meaning) rows that, joined, are the MessagePack of `value` (a message: its body): one row per
    array or map header and per scalar, named by its field path."""
    if isinstance(value, msgspec.Struct):
        names = type(value).__struct_fields__
        rows = [(_container(len(names), 0x90, 0xDC, 0xDD), f"{f'`{path}`' if path else 'the body'}: "
                 f"{_plural(len(names), 'field')}")]
        for name in names:
            rows += body_rows(getattr(value, name), f"{path}.{name}" if path else name)
        return rows
    if isinstance(value, list) and value:
        rows = [(_container(len(value), 0x90, 0xDC, 0xDD), f"`{path}`: {_plural(len(value), 'element')}")]
        for i, item in enumerate(value):
            rows += body_rows(item, f"{path}[{i}]")
        return rows
    if isinstance(value, dict) and value:
        rows = [(_container(len(value), 0x80, 0xDE, 0xDF), f"`{path}`: {_plural(len(value), 'entry')}")]
        for key, item in value.items():
            rows.append((msgspec.msgpack.encode(key), f"key {_literal(key)}"))
            rows += body_rows(item, f"{path}[{_literal(key)}]")
        return rows
    return [(msgspec.msgpack.encode(value), f"`{path}` = {_literal(value)}")]


def frame_lines(frames: list[bytes]) -> list[str]:
    lines = []
    for i, frame in enumerate(frames):
        data = bytes(frame)
        for start in range(0, max(len(data), 1), 16):
            lead = f"frame {i}  " if start == 0 else " " * 9
            lines.append(lead + data[start:start + 16].hex(" "))
    return lines


SHOWN_BYTES = 12
"""A table row shows at most this many bytes of a long str or bin, then "..." (its frame shows them all)."""
_SIZE_BYTES = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}  # str 8..32, bin 8..32: their length field


def string_size(data: bytes) -> int:
    """Bytes taken by the str or bin that `data` starts with (header included)."""
    if 0xA0 <= data[0] <= 0xBF:
        return 1 + (data[0] & 0x1F)
    n = _SIZE_BYTES[data[0]]
    return 1 + n + int.from_bytes(data[1:1 + n], "big")


def bytes_cell(data: bytes) -> str:
    if len(data) <= SHOWN_BYTES + 4 or not (0xA0 <= data[0] <= 0xBF or data[0] in _SIZE_BYTES):
        return data.hex(" ")
    return data[:SHOWN_BYTES].hex(" ") + " ..."


def cells_cover(cells: list[str], body: bytes) -> bool:
    """The bytes cells of a body's table, read in order, are the body: each shows all its bytes, or the
    first ones and "..." for a str or bin that takes string_size bytes."""
    at = 0
    for cell in cells:
        shown = bytes.fromhex(cell.removesuffix(" ..."))
        size = string_size(body[at:]) if cell.endswith(" ...") else len(shown)
        if body[at:at + len(shown)] != shown:
            return False
        at += size
    return at == len(body)


def render_example(msg: Any) -> str:
    """The generated part of a byte example: the frames our codec encodes `msg` to, and its body's table."""
    frames = encode(msg)
    assert len(frames) == 2, "byte examples are messages without tensor frames"
    rows = [f"| `{bytes_cell(data)}` | {msgpack_format(data)} | {meaning} |" for data, meaning in body_rows(msg)]
    return "\n".join(["```", *frame_lines(frames), "```", "", "| bytes | MessagePack | meaning |", "|---|---|---|",
                      *rows]) + "\n"


def byte_examples(text: str) -> list[tuple[str, str]]:
    """(the message as written, its generated part, "" when there is none yet) of each byte example."""
    found = []
    for block in re.split(r"(?m)^(?=### )", section(text, "Byte examples"))[1:]:
        ctor = CONSTRUCTOR.search(block)
        assert ctor, f"SPEC.md, Byte examples: {block.splitlines()[0]} writes no message"
        generated = GENERATED.match(block, ctor.end() + 2)
        found.append((ctor[1], generated[0] if generated else ""))
    return found


def write_examples(text: str) -> str:
    """`text` with the generated part of every byte example rendered anew (added where it is missing)."""
    old = section(text, "Byte examples")
    blocks = re.split(r"(?m)^(?=### )", old)
    for i, block in enumerate(blocks[1:], 1):
        ctor = CONSTRUCTOR.search(block)
        generated = GENERATED.match(block, ctor.end() + 2)
        rest = block[generated.end():] if generated else block[ctor.end() + 1:]
        blocks[i] = block[:ctor.end()] + "\n\n" + render_example(evaluate(ctor[1])) + rest
    return text.replace(old, "".join(blocks))


# ---------------------------------------------------------------------------------------- layouts


def render_layout() -> str:
    """This code's wire layout, as tests/protocol/layouts/v<N>.txt records each version's: the header, every
    structure's and message's fields in wire order (type, bounds, default), the error codes, the dtypes."""
    lines = ["header", "4 bytes: 54 52 <protocol version> <kind>"]
    for cls in wire_classes():
        lines += ["", heading(cls), *(" | ".join(row) for row in table_rows(cls))]
    codes = sorted((v, k) for k, v in vars(ErrorCode).items() if not k.startswith("_"))
    lines += ["", "### error codes", *(f"{code} {name}" for code, name in codes)]
    lines += ["", "### dtypes", *(f"{name} {size}" for name, size in DTYPES.items())]
    return "\n".join(lines) + "\n"


def layout_units(layout: str) -> dict[str, str]:
    """A recorded layout split into what a changelog names: each message or structure (by class name), each
    error code (by number), each dtype (by name), and the header."""
    units: dict[str, str] = {}
    for block in layout.strip().split("\n\n"):
        title, *lines = block.splitlines()
        if title in ("### error codes", "### dtypes"):
            units.update({line.split()[0]: line for line in lines})
        else:  # "header", "### 1 Hello", "### Span (structure)"
            units[title.removeprefix("### ").removesuffix(" (structure)").split()[-1]] = block
    return units


def recorded_layouts() -> dict[int, str]:
    return {int(p.stem[1:]): p.read_text(encoding="utf-8") for p in LAYOUTS.glob("v*.txt")}
