"""Prompt sources for the trainer's controller: built-in synthetic tasks, JSONL and Parquet files, and
Hugging Face `datasets` when installed (`hf:NAME[[:CONFIG]:SPLIT]`). Each row becomes a PromptRecord with
token ids: a text prompt is tokenized as is, a conversational one (a list of turns) through the chat
template (engine/data/chat.py). Parquet files are read a row group at a time (engine/data/parquet_rows.py).

A source has a position (rows consumed so far, counted over all epochs) that checkpoints store, so
`--resume` continues at the same prompt, also inside an epoch. File data is read data.epochs times, each
epoch in file order or, with data.shuffle, in an order drawn from data.seed and the epoch number (so a
resumed run sees the same order). Prompts whose tokens leave no room for max_new_tokens in the model's
context are skipped and counted (`skipped_too_long`), never handed out; so are the evaluation's prompts
(`held_out`, `skipped_held_out`). `check_rows` refuses at start-up conversational rows no chat template can
encode. Test: pytest tests/engine/data/test_data.py tests/engine/data/test_chat_data.py
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tailrace.engine.config import DataConfig
from tailrace.engine.data.chat import MESSAGES_FIELD, ChatTemplate, conversation
from tailrace.engine.data.parquet_rows import ParquetRows

if TYPE_CHECKING:  # samples imports torch; the launcher reads rows (engine/core/preflight.py) without it
    from tailrace.engine.core.samples import PromptRecord


def _rows_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"data.source: {path}:{line_no}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"data.source: {path}:{line_no}: each line must be a JSON object")
            yield row


def parse_hf_source(spec: str) -> tuple[str, str | None, str]:
    """(name, config or None, split) of `hf:NAME`, `hf:NAME:SPLIT` or `hf:NAME:CONFIG:SPLIT`. NAME is a
    hub id (it may hold "/", as in openai/gsm8k) or a local folder; it cannot hold ":" or "[". SPLIT may
    end with a row selection in brackets, as `datasets` takes it (train[:100])."""
    assert spec.startswith("hf:")
    body, bracket, selection = spec[3:].partition("[")  # a split may select rows: train[:100], test[10%:]
    parts = body.split(":")
    if len(parts) > 3 or not all(parts) or (bracket and (len(parts) == 1 or not selection.endswith("]"))):
        raise ValueError(f"data.source: {spec!r} is not hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT "
                         f"(e.g. hf:openai/gsm8k:main:train)")
    name, config = parts[0], parts[1] if len(parts) == 3 else None
    split = parts[-1] + bracket + selection if len(parts) > 1 else "train"
    return name, config, split


def _rows_hf(spec: str) -> Iterable[dict[str, Any]]:
    """A `datasets` Dataset: iterable, and with len() and random access."""
    name, config, split = parse_hf_source(spec)
    try:
        import datasets
    except ImportError:
        raise ValueError("data.source: hf:NAME needs the `datasets` package: pip install datasets") from None
    if config is None:
        return datasets.load_dataset(name, split=split)
    return datasets.load_dataset(name, config, split=split)


def _source_path(cfg: DataConfig) -> Path:
    path = Path(cfg.source)
    if not path.is_file():
        raise ValueError(f"data.source: {cfg.source!r} is not 'synthetic', 'hf:NAME' or an existing file")
    if path.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"data.source: {path.name}: expected a .jsonl or .parquet file")
    return path


def file_rows(cfg: DataConfig) -> Iterable[dict[str, Any]]:
    """The rows of a file source in file order, read as they are consumed."""
    if cfg.source.startswith("hf:"):
        return _rows_hf(cfg.source)
    path = _source_path(cfg)
    if path.suffix == ".parquet":
        return ParquetRows(path).epoch_rows(0, 0, shuffle=False, seed=0)
    return _rows_jsonl(path)


def _scalar_metadata(row: dict[str, Any], prompt_field: str) -> dict[str, Any]:
    return {k: v for k, v in row.items()
            if k != prompt_field and (v is None or isinstance(v, str | int | float | bool))}


def row_table(cfg: DataConfig) -> Sequence[dict[str, Any]] | ParquetRows:
    """A file source with its length: Parquet read by row group, a `datasets` Dataset (random access)
    as it is, JSONL rows in a list."""
    if not cfg.source.startswith("hf:") and _source_path(cfg).suffix == ".parquet":
        return ParquetRows(cfg.source)
    rows = file_rows(cfg)
    return rows if hasattr(rows, "__getitem__") else list(rows)


def epoch_rows(table: Sequence[dict[str, Any]] | ParquetRows, cfg: DataConfig, position: int) -> Iterator[dict[str, Any]]:
    """The rows of data.epochs passes over `table` from row `position` (counted over all epochs), each
    epoch in file order or, with data.shuffle, in an order drawn from data.seed and the epoch number."""
    n = len(table)
    if n == 0:
        return
    epoch, offset = divmod(position, n)
    while epoch < cfg.epochs:
        if isinstance(table, ParquetRows):
            yield from table.epoch_rows(epoch, offset, shuffle=cfg.shuffle, seed=cfg.seed)
        else:
            order = list(range(n))
            if cfg.shuffle:
                random.Random(f"{cfg.seed}/{epoch}").shuffle(order)
            for i in order[offset:]:
                yield table[i]
        epoch, offset = epoch + 1, 0


def exhausted_text(cfg: DataConfig, num_rows: int | None, what: str) -> str:
    """Why a source of `num_rows` rows per epoch (None: endless) ended, for the run's stop reason."""
    if num_rows is None:
        return "data exhausted"
    epochs = cfg.epochs
    return (f"data exhausted after {epochs} epoch{'s' if epochs != 1 else ''} of {num_rows} {what} "
            f"(data.epochs = {epochs})")


CHECKED_ROWS = 1000  # rows check_rows reads at start-up; a bad row further on stops the run when admitted


def check_rows(cfg: DataConfig, tokenizer: Any, num_rows: int = CHECKED_ROWS) -> None:
    """Refuse, before any model loads, a file source whose first `num_rows` rows hold a conversational row
    that data.chat_template cannot encode (no template in the tokenizer, or "none"): the same ValueError
    that admitting the row would raise, naming data.chat_template, but at start-up instead of mid-run."""
    chat = ChatTemplate(cfg.chat_template, tokenizer)
    if cfg.source == "synthetic" or chat.usable():
        return
    for index, row in enumerate(itertools.islice(file_rows(cfg), num_rows)):
        if (turns := conversation(row, cfg.prompt_field, index)) is not None:
            chat.encode(turns[0], index)  # raises


class PromptSource:
    """Iterator of PromptRecord from the configured source, starting at `position`."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, max_prompt_tokens: int, position: int = 0,
                 held_out: frozenset[str] = frozenset(), split: str = "train"):
        """held_out: prompt texts never yielded (the evaluation's prompts), skipped and counted.
        split: the synthetic stream ("eval": the held-out one, engine/data/tasks.py)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.position = position
        self.held_out = held_out
        self.split = split
        self.skipped_too_long = 0
        self.skipped_held_out = 0
        self.num_rows: int | None = None  # rows per epoch; None for the endless synthetic stream
        self._chat = ChatTemplate(cfg.chat_template, tokenizer)  # a bad data.chat_template fails here
        if cfg.source == "synthetic":
            self._rows = self._synthetic_rows()
        else:
            table = row_table(cfg)
            self.num_rows = len(table)
            self._rows = epoch_rows(table, cfg, position)

    @property
    def epochs_done(self) -> int:
        """Complete passes over the file data so far (0 for synthetic data)."""
        return self.position // self.num_rows if self.num_rows else 0

    def exhausted_text(self) -> str:
        """Why the source ended, for the run's stop reason."""
        return exhausted_text(self.cfg, self.num_rows, "prompts")

    def _synthetic_rows(self) -> Iterator[dict[str, Any]]:
        from tailrace.engine.data.tasks import synthetic_prompts

        for prompt in synthetic_prompts(self.cfg.task, seed=self.cfg.seed, start=self.position, split=self.split):
            yield {self.cfg.prompt_field: prompt.text, "task": prompt.task} | dict(prompt.metadata)

    def __iter__(self) -> PromptSource:
        return self

    def __next__(self) -> PromptRecord:
        from tailrace.engine.core.samples import PromptRecord

        while True:
            row = next(self._rows)  # StopIteration ends the source
            index = self.position
            token_ids, text, answer = self._encode(row, index)  # a bad row stops the run: not yet consumed,
            self.position += 1  # so that a resume after fixing the setting reads it again
            if text in self.held_out:
                self.skipped_held_out += 1
                continue
            if len(token_ids) > self.max_prompt_tokens:
                self.skipped_too_long += 1
                continue
            task = row.get("task") if isinstance(row.get("task"), str) else self.cfg.task
            metadata = _scalar_metadata(row, self.cfg.prompt_field)
            if self.cfg.answer_field in row and self.cfg.answer_field != "answer":
                metadata["answer"] = row[self.cfg.answer_field]
            elif self.cfg.answer_field not in row and answer is not None:
                metadata["answer"] = answer
            metadata["task"] = task
            return PromptRecord(index, list(token_ids), text, task, metadata)

    def _encode(self, row: dict[str, Any], index: int) -> tuple[list[int], str, str | None]:
        """(token ids, prompt text as the reward sees it, the answer a `messages` row ends with)."""
        chat = conversation(row, self.cfg.prompt_field, index)
        if chat is not None:
            turns, answer = chat
            return *self._chat.encode(turns, index), answer
        text = row.get(self.cfg.prompt_field)
        if not isinstance(text, str):
            raise ValueError(f"data: row {index} has no string field {self.cfg.prompt_field!r}, nor a list of "
                             f"turns there or in {MESSAGES_FIELD!r} (set data.prompt_field)")
        return list(self.tokenizer.encode(text)), text, None
