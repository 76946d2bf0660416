"""Conversational rows (a list of {role, content} turns) through the chat template, exactly as
tokenizer.apply_chat_template(..., add_generation_prompt=True) gives them, with the shipped tiny
tokenizer given a template here (it ships none), for GRPO prompts and DPO pairs.
Run: pytest tests/engine/data/test_chat_data.py
"""

import json

import pytest

from tailrace.engine.config import DataConfig
from tailrace.engine.core import models
from tailrace.engine.data.prompt_sources import PromptSource, check_rows

# Only characters of the tiny model's vocabulary, so that every token is a real one (no <unk>).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }};{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
OTHER_TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


@pytest.fixture
def tokenizer():
    tok = models.load_tokenizer("tiny")
    assert not tok.chat_template  # the case the override and the error are for
    tok.chat_template = TEMPLATE
    return tok


def _file(tmp_path, rows):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _reference_ids(tokenizer, turns, **kwargs):
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "rev:abc="}]


def test_a_prompt_given_as_turns_gets_the_token_ids_of_apply_chat_template(tmp_path, tokenizer):
    rows = [{"prompt": TURNS, "answer": "cba", "level": 2}, {"prompt": "rev:xy="}]
    source = PromptSource(DataConfig(source=_file(tmp_path, rows), task="math"), tokenizer, max_prompt_tokens=100)
    chat, text = list(source)
    assert chat.token_ids == _reference_ids(tokenizer, TURNS)
    assert chat.text == "<bos>[system]be brief;[user]rev:abc=;[assistant]"
    assert tokenizer.unk_token_id not in chat.token_ids
    assert chat.metadata == {"answer": "cba", "level": 2, "task": "math"}  # scalars only: no turns
    assert text.token_ids == tokenizer.encode("rev:xy=") and text.text == "rev:xy="  # text rows as before


def test_a_messages_row_ending_with_the_answer_is_the_prompt_before_it(tmp_path, tokenizer):
    rows = [{"messages": [*TURNS, {"role": "assistant", "content": "cba"}], "id": 7},
            {"messages": TURNS, "solution": "zz"}]
    cfg = DataConfig(source=_file(tmp_path, rows), answer_field="solution")
    sft, prompt_only = list(PromptSource(cfg, tokenizer, max_prompt_tokens=100))
    assert sft.token_ids == _reference_ids(tokenizer, TURNS) == prompt_only.token_ids
    assert sft.metadata == {"answer": "cba", "id": 7, "task": "reverse"}
    assert prompt_only.metadata["answer"] == "zz"  # the row's answer field wins over nothing


def test_a_template_file_overrides_the_tokenizers(tmp_path, tokenizer):
    template = tmp_path / "chat.jinja"
    template.write_text(OTHER_TEMPLATE)
    cfg = DataConfig(source=_file(tmp_path, [{"prompt": TURNS}]), chat_template=str(template))
    (record,) = PromptSource(cfg, tokenizer, max_prompt_tokens=100)
    assert record.text == "s:be brief|u:rev:abc=|a:"
    assert record.token_ids == _reference_ids(tokenizer, TURNS, chat_template=OTHER_TEMPLATE)
    assert record.token_ids != _reference_ids(tokenizer, TURNS)


def test_too_long_chat_prompts_are_skipped_by_their_templated_length(tmp_path, tokenizer):
    n = len(_reference_ids(tokenizer, TURNS))
    cfg = DataConfig(source=_file(tmp_path, [{"prompt": TURNS}]))
    assert len(list(PromptSource(cfg, tokenizer, max_prompt_tokens=n))) == 1
    short = PromptSource(cfg, tokenizer, max_prompt_tokens=n - 1)
    assert list(short) == [] and short.skipped_too_long == 1


def test_conversational_rows_without_a_template_name_data_chat_template(tmp_path, tokenizer):
    source = _file(tmp_path, [{"prompt": TURNS}])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="row 0 is conversational but the tokenizer has no chat template; "
                                         "set data.chat_template"):
        next(PromptSource(DataConfig(source=source), tokenizer, max_prompt_tokens=100))
    with pytest.raises(ValueError, match='data.chat_template = "none"'):
        next(PromptSource(DataConfig(source=source, chat_template="none"), tokenizer, max_prompt_tokens=100))
    with pytest.raises(ValueError, match="data.chat_template: .*missing.jinja' is not auto, none"):
        PromptSource(DataConfig(source=source, chat_template=str(tmp_path / "missing.jinja")), tokenizer,
                     max_prompt_tokens=100)


def test_chat_rows_no_template_can_encode_are_refused_at_start_up_before_the_model_loads(tmp_path, tokenizer,
                                                                                        monkeypatch):
    text = {"prompt": "rev:abc="}
    tokenizer.chat_template = None
    cfg = DataConfig(source=_file(tmp_path, [text, text, {"prompt": TURNS}]))
    with pytest.raises(ValueError, match="row 2 is conversational but the tokenizer has no chat template; "
                                         "set data.chat_template"):
        check_rows(cfg, tokenizer)
    check_rows(cfg, tokenizer, num_rows=2)  # only the first rows are read: a later one fails when admitted
    (tmp_path / "text").mkdir()
    check_rows(DataConfig(source=_file(tmp_path / "text", [text] * 3)), tokenizer)  # text rows need no template
    tokenizer.chat_template = TEMPLATE
    check_rows(cfg, tokenizer)
    # The trainer checks right after its tokenizer, before any model loads (issue 31: it hung mid-run).
    from tailrace.engine.config import load_config
    from tailrace.engine.trainer import service

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")

    monkeypatch.setattr(service.models, "load_model", no_model)
    tokenizer.chat_template = None  # models.load_tokenizer hands the trainer this (cached) tokenizer
    run = load_config(None, ["--data.source", cfg.source, "--trainer.runs_dir", str(tmp_path / "runs")])
    with pytest.raises(ValueError, match="data.chat_template"):
        service.TrainerService(run)


def test_malformed_turns_are_a_clear_error(tmp_path, tokenizer):
    for row, match in (({"prompt": [{"content": "no role"}]}, r"prompt\[0\] must be a \{role, content\} turn"),
                       ({"messages": [{"role": "assistant", "content": "x"}]}, "no turn before the answer"),
                       ({"other": 1}, "no string field 'prompt', nor a list of turns there or in 'messages'")):
        with pytest.raises(ValueError, match=match):
            next(PromptSource(DataConfig(source=_file(tmp_path, [row])), tokenizer, max_prompt_tokens=100))


def test_dpo_prompts_given_as_turns_go_through_the_template_too(tmp_path, tokenizer):
    from tailrace.engine.data.dpo_pairs import PairSource

    rows = [{"prompt": TURNS, "chosen": "cba", "rejected": "abc"}, {"prompt": "rev:ab=", "chosen": "ba", "rejected": "ab"}]
    chat, text = PairSource(DataConfig(source=_file(tmp_path, rows)), tokenizer, max_tokens=100)
    assert chat.prompt_ids == _reference_ids(tokenizer, TURNS)
    assert text.prompt_ids == tokenizer.encode("rev:ab=")
    assert chat.chosen_ids == tokenizer.encode("cba", add_special_tokens=False) + [tokenizer.eos_token_id]
