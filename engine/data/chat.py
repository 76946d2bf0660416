"""Conversational prompts: a row whose prompt is a list of {role, content} turns, as TRL's and verl's
datasets give them, becomes token ids through the tokenizer's chat template, with the generation prompt
appended (`tokenizer.apply_chat_template(turns, add_generation_prompt=True)`), exactly as TRL's GRPO does.

The turns are the `data.prompt_field` value when it is a list, else the row's `messages` list; a
`messages` list that ends with an assistant turn is a prompt with its reference answer (an SFT row): the
answer turn leaves the prompt and becomes the reward metadata's "answer" when the row has no answer
field. `data.chat_template`: "auto" uses the tokenizer's template, "none" refuses conversational rows, a
file path is a Jinja template that overrides the tokenizer's, and the trainers save it as the tokenizer's
own template in every checkpoint (adopt_template). Test: pytest tests/engine/data/test_chat_data.py
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

MESSAGES_FIELD = "messages"

Turns = list[dict[str, Any]]


def conversation(row: Mapping[str, Any], prompt_field: str, index: int) -> tuple[Turns, str | None] | None:
    """(the prompt's turns, the reference answer a `messages` row ends with, or None), or None when the
    row's prompt is not conversational."""
    value = row.get(prompt_field)
    from_messages = value is None and isinstance(row.get(MESSAGES_FIELD), list)
    turns = row[MESSAGES_FIELD] if from_messages else value
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns):
        if not (isinstance(turn, Mapping) and isinstance(turn.get("role"), str) and "content" in turn):
            field = MESSAGES_FIELD if from_messages else prompt_field
            raise ValueError(f"data: row {index}: {field}[{i}] must be a {{role, content}} turn, got {turn!r:.80}")
    turns = [dict(turn) for turn in turns]
    answer = None
    if from_messages and turns and turns[-1]["role"] == "assistant":
        answer = turns.pop()["content"]
        answer = answer if isinstance(answer, str) else None
    if not turns:
        raise ValueError(f"data: row {index}: the conversation has no turn before the answer")
    return turns, answer


class ChatTemplate:
    """data.chat_template resolved against a tokenizer: encode(turns) -> (token ids, rendered text)."""

    def __init__(self, setting: str, tokenizer: Any):
        self.setting = setting
        self.tokenizer = tokenizer
        self.override: str | None = None
        if setting not in ("auto", "none"):
            path = Path(setting)
            if not path.is_file():
                raise ValueError(f"data.chat_template: {setting!r} is not auto, none or an existing Jinja template file")
            self.override = path.read_text(encoding="utf-8")

    def usable(self) -> bool:
        """Whether conversational rows can be encoded at all (else encode raises, naming data.chat_template)."""
        return self.setting != "none" and (self.override is not None or bool(getattr(self.tokenizer, "chat_template", None)))

    def encode(self, turns: Turns, index: int) -> tuple[list[int], str]:
        if self.setting == "none":
            raise ValueError(f"data: row {index} is conversational (a list of turns) but data.chat_template = "
                             f'"none"; set it to "auto" or a Jinja template file, or give the prompt as text')
        if self.override is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"data: row {index} is conversational but the tokenizer has no chat template; set "
                             f"data.chat_template to a Jinja template file (or give the prompt as text)")
        from jinja2 import (
            TemplateError,  # transformers' dependency; the template's raise_exception() raises it
        )

        kwargs = dict(add_generation_prompt=True, chat_template=self.override)
        try:
            text = self.tokenizer.apply_chat_template(turns, tokenize=False, **kwargs)
            ids = self.tokenizer.apply_chat_template(turns, tokenize=True, **kwargs)
        except TemplateError as exc:  # e.g. a role the template refuses: name the row, as for any bad row
            raise ValueError(f"data: row {index}: the chat template cannot render it: {exc}") from exc
        if isinstance(ids, Mapping):  # transformers >= 5 returns a BatchEncoding by default
            ids = ids["input_ids"]
        return [int(i) for i in ids], text


def adopt_template(setting: str, tokenizer: Any) -> None:
    """A data.chat_template file becomes the tokenizer's own template, so the checkpoints' tokenizer files
    carry the template the run trained with: from_pretrained(checkpoint) formats conversations alike."""
    template = ChatTemplate(setting, tokenizer).override
    if template is not None:
        tokenizer.chat_template = template
