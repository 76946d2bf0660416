"""The documentation stays a landing page plus pages that hold together: README.md is short, every relative
link in README.md and docs/*.md reaches a file (and the heading its #anchor names), every repository file they
and protocol/SPEC.md name in prose or code (`tests/...py`, `examples/...`) exists, and the from-scratch
tokenizer recipe of docs/model-and-data.md builds what tailrace loads.

Run: pytest tests/test_docs.py
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
MAX_LINE_CHARS = 200

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if not path.exists():
            problems.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{target}: {path.name} has no heading #{anchor}")
    return problems


def test_the_readme_is_a_short_landing_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"
    long = [(n, len(line)) for n, line in enumerate(lines, start=1) if len(line) > MAX_LINE_CHARS]
    assert not long, f"README.md lines over {MAX_LINE_CHARS} characters (line, length): {long}"


def test_the_checker_sees_links_and_anchors(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Two words: `code`!\n\n## Two words: `code`!\n\nSee [b](b.md#part).\n"
                                   "`[not](a link.md)`\n```\n[not](either.md)\n```\n[self](#title) [gone](c.md)\n")
    (tmp_path / "b.md").write_text("## Other part\n")
    assert anchors(tmp_path / "a.md") == {"title", "two-words-code", "two-words-code-1"}
    assert broken_links(tmp_path / "a.md") == ["b.md#part: b.md has no heading #part", "c.md: no such file"]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_reach_a_file_and_heading(page):
    assert broken_links(page) == []


REPO_PATH = re.compile(r"(?<![\w./-])((?:engine|kernels|protocol|tools|tests|examples|docs)/"
                       r"[\w./-]*\w\.(?:py|sh|toml|md|txt|jsonl))")


def missing_paths(page: Path) -> list[str]:
    """Repository files a page names anywhere (prose, code spans, code blocks) that do not exist."""
    named = sorted(set(REPO_PATH.findall(page.read_text(encoding="utf-8"))))
    return [name for name in named if not (ROOT / name).exists()]


def test_the_path_checker_sees_paths_in_prose_and_code(tmp_path):
    (tmp_path / "a.md").write_text("See tests/test_docs.py and `tests/engine/gone.py`; runs/x/a.py is not ours.\n"
                                   "```\npython examples/nowhere/x.py --out docs/y.md\n```\n")
    assert missing_paths(tmp_path / "a.md") == ["docs/y.md", "examples/nowhere/x.py", "tests/engine/gone.py"]


SPEC = ROOT / "protocol" / "SPEC.md"


@pytest.mark.parametrize("page", [*PAGES, SPEC], ids=[p.name for p in [*PAGES, SPEC]])
def test_repository_files_named_in_the_docs_exist(page):
    assert missing_paths(page) == []


def test_the_docs_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def _python_block(page: Path, section: str) -> str:
    text = page.read_text(encoding="utf-8")
    body = text[text.index(f"\n## {section}\n"):]
    start = body.index("```python\n") + len("```python\n")
    return body[start: body.index("```", start)]


def test_the_from_scratch_tokenizer_recipe_builds_what_tailrace_loads(tmp_path, monkeypatch):
    from tailrace.engine.core import models, preflight
    from tailrace.engine.data.chat import ChatTemplate

    monkeypatch.chdir(tmp_path)
    exec(compile(_python_block(ROOT / "docs" / "model-and-data.md", "A tokenizer for a model built from scratch"),
                 "model-and-data.md", "exec"), {})
    tokenizer = models.load_tokenizer(tmp_path / "my_model")
    model = models.load_model(tmp_path / "my_model")  # a supported family, refused otherwise
    assert preflight.round_trip_warning(tokenizer, "my_model") is None
    assert tokenizer.eos_token_id in models.eos_token_ids(model, tokenizer)
    turns = [{"role": "system", "content": "answer with a number."}, {"role": "user", "content": "2+3?"}]
    ids, text = ChatTemplate("auto", tokenizer).encode(turns, 0)
    assert text == "<bos>system: answer with a number.\nuser: 2+3?\nassistant: "
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids) == text
    assert max(ids) < model.get_input_embeddings().num_embeddings


def test_docstrings_name_test_files_that_exist():
    """Every `Test: pytest PATH` / `Run: pytest PATH` line of a module docstring names a file that exists
    (moved tests left such lines stale)."""
    stale = []
    for folder in ("engine", "kernels", "protocol", "tools", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for match in re.finditer(r"(?:Test|Run): (?:python -m )?pytest ([^\n]*)", line):
                    for name in re.findall(r"tests/[\w/]+(?:\.py)?", match.group(1)):
                        if not (ROOT / name).exists():
                            stale.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert stale == []
