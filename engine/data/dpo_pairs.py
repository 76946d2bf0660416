"""Preference pairs for `train.algorithm = "dpo"`: rows with a prompt, a chosen and a rejected completion.

Rows come from the same readers as GRPO prompts (engine/data/prompt_sources.py: JSONL, Parquet, `hf:NAME`); the prompt
is the `data.prompt_field` column, tokenized as the GRPO path tokenizes prompts (text as is, a list of
turns through the chat template, engine/data/chat.py); `chosen` and `rejected` are text, tokenized without
special tokens, and end with the tokenizer's EOS, as a sampled completion that stopped would. The rows are
read data.epochs times, each epoch in file order or, with data.shuffle, in an order drawn from data.seed and
the epoch, as GRPO prompts are. A source has a position (rows consumed, over all epochs) that checkpoints
store, so `--resume` continues at the same row; pairs too long for the model are skipped and counted.
Test: pytest tests/engine/trainer/test_dpo.py
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tailrace.engine.config import DataConfig
from tailrace.engine.data.chat import ChatTemplate, conversation
from tailrace.engine.data.prompt_sources import epoch_rows, exhausted_text, row_table

COMPLETION_FIELDS = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """Row `index` of the source as token ids: prompt [P], chosen [C], rejected [R], each non-empty."""

    index: int
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


class PairSource:
    """Iterator of PreferencePair from the configured file, starting at row `position`.

    max_tokens: the longest prompt + completion the model takes (its context); max_prompt_tokens: the
    longest prompt (data.max_prompt_tokens, 0 = no limit of its own). Longer pairs are skipped and counted.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, max_tokens: int, position: int = 0):
        if cfg.source == "synthetic":
            raise ValueError("data.source: train.algorithm = \"dpo\" needs a .jsonl / .parquet file or hf:NAME "
                             "with prompt, chosen and rejected fields")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.position = position
        self.skipped_too_long = 0
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos = [eos] if isinstance(eos, int) else []
        self._chat = ChatTemplate(cfg.chat_template, tokenizer)
        table = row_table(cfg)
        self.num_rows = len(table)  # per epoch
        self._rows = epoch_rows(table, cfg, position)

    def __iter__(self) -> Iterator[PreferencePair]:
        return self

    def __next__(self) -> PreferencePair:
        while True:
            row = next(self._rows)  # StopIteration ends the source
            index = self.position
            self.position += 1
            pair = PreferencePair(index, self._prompt(row, index),
                                  *(self._completion(row, index, name) for name in COMPLETION_FIELDS))
            too_long_prompt = 0 < self.cfg.max_prompt_tokens < len(pair.prompt_ids)
            if pair.num_tokens > self.max_tokens or too_long_prompt:
                self.skipped_too_long += 1
                continue
            return pair

    def exhausted_text(self) -> str:
        """Why the source ended, for the run's stop reason."""
        return exhausted_text(self.cfg, self.num_rows, "rows")

    def take(self, num_pairs: int) -> list[PreferencePair]:
        """Up to num_pairs next pairs; fewer (or none) when the source ends."""
        out: list[PreferencePair] = []
        for pair in self:
            out.append(pair)
            if len(out) == num_pairs:
                break
        return out

    def _prompt(self, row: dict[str, Any], index: int) -> list[int]:
        chat = conversation(row, self.cfg.prompt_field, index)
        if chat is not None:  # the turns through the chat template, as a GRPO prompt's
            return self._chat.encode(chat[0], index)[0]
        return list(self.tokenizer.encode(self._text(row, index, self.cfg.prompt_field)))

    def _text(self, row: dict[str, Any], index: int, name: str) -> str:
        value = row.get(name)
        if not isinstance(value, str) or not value:
            shown = "missing" if name not in row else f"{type(value).__name__} {str(value)[:40]!r}"
            hint = " (set data.prompt_field)" if name == self.cfg.prompt_field else ""
            raise ValueError(f"data: row {index} of {self.cfg.source}: field {name!r} must be a non-empty "
                             f"string, got {shown}{hint}")
        return value

    def _completion(self, row: dict[str, Any], index: int, name: str) -> list[int]:
        ids = list(self.tokenizer.encode(self._text(row, index, name), add_special_tokens=False)) + self._eos
        if not ids:
            raise ValueError(f"data: row {index} of {self.cfg.source}: field {name!r} has no tokens")
        return ids
