"""The shipped 12-layer long-tail policy (examples/tiny_longtail, model name "tiny_longtail") and the
pretraining options that build it (tools/make_tiny_model.py --lengths, --curriculum-steps).

Run: pytest tests/engine/test_tiny_longtail.py   (greedy answers of the trained policy: -m slow)
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest

from tailrace.engine.core import models, preflight
from tailrace.engine.data import tasks
from tools import make_tiny_model


def test_shipped_longtail_policy_loads_and_is_its_recipes_model():
    model = models.load_model("tiny_longtail")
    tokenizer = models.load_tokenizer("tiny_longtail")
    assert model.config.num_hidden_layers >= 12
    folder = models.SHIPPED_MODELS["tiny_longtail"]
    assert models.resolve_model_path("tiny_longtail") == str(folder)
    preflight.check_model_path("tiny_longtail")  # model.path = "tiny_longtail" names it
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 8e6
    # The recipe in the docstring and docs/benchmarks.md builds this shape: same config, same generation defaults.
    recipe = " ".join(make_tiny_model.LONGTAIL_RECIPE)
    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert recipe in " ".join(make_tiny_model.__doc__.replace("\\\n", " ").split())
    assert recipe in " ".join(page.replace("\\\n", " ").split())
    args = make_tiny_model.parse_args(make_tiny_model.LONGTAIL_RECIPE)
    assert args.task == "reverse_longtail" and args.out.name == folder.name
    built = make_tiny_model.build_model(make_tiny_model.build_tokenizer(), args.hidden_size, args.num_layers,
                                        tasks.max_length(args.task) + 16)
    ignore = {"transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures"}
    assert ({k: v for k, v in model.config.to_dict().items() if k not in ignore}
            == {k: v for k, v in built.config.to_dict().items() if k not in ignore})
    assert model.generation_config.to_diff_dict() | {"transformers_version": None} == \
        built.generation_config.to_diff_dict() | {"transformers_version": None}
    text = "rev:" + "abcxyz" * 21 + "="
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


def test_loguniform_pretraining_lengths_fill_every_octave_up_to_the_cap():
    cap = {"value": 128}
    stream = make_tiny_model._train_prompts("reverse_longtail", 0, "loguniform", lambda: cap["value"],
                                            random.Random(0))
    prompts = [next(stream) for _ in range(7000)]
    lengths = [int(p.metadata["length"]) for p in prompts]
    assert min(lengths) == 1 and max(lengths) == 128
    octaves = Counter(int(math.log2(n)) for n in lengths)  # [1, 2), [2, 4), ... [64, 128]
    assert sorted(octaves) == list(range(8))
    for k in range(7):  # each octave 1 / log2(129) of the mass, about 0.143
        assert 0.12 <= octaves[k] / len(lengths) <= 0.165, (k, octaves)
    p = prompts[5]
    assert p.text == f"rev:{str(p.metadata['answer'])[::-1]}=" and p.task == "reverse_longtail"
    cap["value"] = 9
    assert max(int(next(stream).metadata["length"]) for _ in range(500)) == 9


def test_curriculum_cap_grows_from_short_strings_to_the_longest():
    caps = [make_tiny_model.curriculum_cap(step, 100, 128) for step in range(0, 150)]
    assert caps[0] == 8 and caps[100] == caps[-1] == 128 and max(caps) == 128
    assert all(a <= b for a, b in zip(caps[:-1], caps[1:], strict=True)) and caps[50] == 68
    assert make_tiny_model.curriculum_cap(0, 0, 128) == 128


@pytest.mark.slow
def test_trained_longtail_policy_answers_as_long_as_the_answer():
    """Greedy: short strings reversed exactly, and long ones (60-120 characters) answered at length, most
    of each answer's tokens produced (the 4-layer policy deepened to 12 layers stops after about 10 here,
    reward under 0.11), as the long-tail workload needs."""
    import torch

    torch.set_num_threads(1)
    model, tokenizer = models.load_model("tiny_longtail"), models.load_tokenizer("tiny_longtail")
    rng = random.Random(3)
    long_rewards, long_shares = [], []
    for n in (3, 12, 60, 70, 80, 90, 100, 120):
        prompt = tasks.prompt_for_string("reverse_longtail", "".join(rng.choice(tasks.ALPHABET) for _ in range(n)))
        ids = torch.tensor([tokenizer(prompt.text)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=160)
        completion = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        if n <= 12:
            assert completion == prompt.metadata["answer"]
            continue
        assert len(completion) >= 20, (n, completion)
        long_rewards.append(tasks.score(prompt.text, completion, prompt.metadata))
        long_shares.append(len(completion) / n)
    assert sum(long_shares) / len(long_shares) >= 0.5, long_shares
    assert sum(long_rewards) / len(long_rewards) >= 0.25, long_rewards
