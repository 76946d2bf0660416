"""Built-in synthetic tasks and their reward functions (pure Python, no torch).

The default task, ``reverse``: the prompt is ``rev:<s>=`` where ``<s>`` is a random lowercase string,
and the answer is ``<s>`` reversed, then EOS (``rev:abcde=`` -> ``edcba``). ``copy`` is the same with
``copy:<s>=`` and the answer ``<s>``. The length of ``<s>`` is log-normal (median 6, sigma 0.8, from 1
to 64 characters), so response lengths are heavy-tailed: p99 is about 6x the median. ``reverse_longtail``
is ``reverse`` (same prompts, same reward) with median 1.2, sigma 1.8, up to 128: p99 about 30x the median. All
samples of a group share the prompt, and a policy that has learnt the task shares the first answer
characters too.

Rewards lie in [0, 1] with partial credit, so samples of one group differ and GRPO has signal:
``1 - levenshtein(completion, answer) / max(len(completion), len(answer))`` — 1.0 only for the exact
answer, 0.0 for an empty completion, low for garbage, and lower for a completion that runs on too long.

Prompt ``i`` of a stream is a pure function of ``(task, seed, i)``, so a resumed run continues exactly:
``synthetic_prompts("reverse", seed=0, start=i)``. ``score`` has the reward-server SDK signature, and
its ``tasks`` attribute names the tasks it scores (a reward server registers those).
Test: ``pytest tests/engine/data/test_tasks.py``.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

DEFAULT_TASK = "reverse"

# Length of the random string: round(exp(N(log(median), sigma))), clipped to [min, max].
LENGTH_MEDIAN = 6.0
LENGTH_SIGMA = 0.8
MIN_LENGTH = 1
MAX_LENGTH = 64
ALPHABET = string.ascii_lowercase

# The tiny model's character vocabulary (tools/make_tiny_model.py): special tokens first, then one
# token per character. 64 entries; the tasks use lowercase letters and ":=".
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = string.ascii_lowercase + string.digits + " :=+-*/.,;!?()[]{}<>_#|'"
VOCAB = SPECIAL_TOKENS + tuple(CHARACTERS)

MetadataValue = str | int | float


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a task. ``metadata`` always holds ``task`` and the reference ``answer``."""

    prompt_id: int
    text: str
    task: str
    metadata: dict[str, MetadataValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _StringTask:
    prefix: str  # the prompt is f"{prefix}{s}="
    transform: Callable[[str], str]
    length_median: float = LENGTH_MEDIAN  # of the random string <s>, log-normal
    length_sigma: float = LENGTH_SIGMA
    max_length: int = MAX_LENGTH


_TASKS: dict[str, _StringTask] = {
    "reverse": _StringTask(prefix="rev:", transform=lambda s: s[::-1]),
    "copy": _StringTask(prefix="copy:", transform=lambda s: s),
    # The long-tail workload (tools/bench.py pipeline --workload longtail): reverse, with string lengths
    # of median 1.2 and sigma 1.8 (up to 128), so that p99 is about 30x the median, as in the papers'.
    "reverse_longtail": _StringTask(prefix="rev:", transform=lambda s: s[::-1], length_median=1.2,
                                    length_sigma=1.8, max_length=128),
}
TASK_NAMES = tuple(_TASKS)


def _task(task: str) -> _StringTask:
    if task not in _TASKS:
        raise ValueError(f"task: unknown task {task!r}; built-in tasks are {', '.join(TASK_NAMES)}")
    return _TASKS[task]


def sample_length(rng: random.Random, median: float = LENGTH_MEDIAN, sigma: float = LENGTH_SIGMA,
                  max_length: int = MAX_LENGTH) -> int:
    """Log-normal string length, the source of the heavy tail."""
    length = round(math.exp(rng.gauss(math.log(median), sigma)))
    return min(max(length, MIN_LENGTH), max_length)


def make_prompt(task: str, seed: int, index: int, *, split: str = "train") -> Prompt:
    """Prompt ``index`` of the stream ``(task, seed)``; a pure function of its arguments. ``split="eval"``
    is another stream of the same task (the held-out prompts of docs/algorithms.md, "Evaluation"); texts the two
    streams share are kept out of training by the trainer, not here."""
    spec = _task(task)
    if index < 0:
        raise ValueError(f"index: must be >= 0, got {index}")
    # Seeding with a str goes through sha512: stable across processes, whatever PYTHONHASHSEED is.
    rng = random.Random(f"{task}:{seed}:{index}" if split == "train" else f"{task}:{seed}:{split}:{index}")
    length = sample_length(rng, spec.length_median, spec.length_sigma, spec.max_length)
    return prompt_for_string(task, "".join(rng.choice(ALPHABET) for _ in range(length)), index)


def prompt_for_string(task: str, s: str, index: int = 0) -> Prompt:
    """The prompt of ``task`` for the random string ``s`` (pretraining draws its own lengths:
    tools/make_tiny_model.py --lengths)."""
    spec = _task(task)
    answer = spec.transform(s)
    metadata: dict[str, MetadataValue] = {"task": task, "answer": answer, "length": len(answer)}
    return Prompt(prompt_id=index, text=f"{spec.prefix}{s}=", task=task, metadata=metadata)


def max_length(task: str) -> int:
    """The longest random string of ``task``'s prompts."""
    return _task(task).max_length


def synthetic_prompts(task: str = DEFAULT_TASK, seed: int = 0, start: int = 0, *,
                      split: str = "train") -> Iterator[Prompt]:
    """Endless, deterministic prompts ``start, start + 1, ...`` of ``task`` (and ``split``)."""
    _task(task)
    index = start
    while True:
        yield make_prompt(task, seed, index, split=split)
        index += 1


def reference_answer(task: str, prompt_text: str) -> str:
    """The exact answer to ``prompt_text``, recomputed from the prompt (metadata is not trusted)."""
    spec = _task(task)
    if not (prompt_text.startswith(spec.prefix) and prompt_text.endswith("=")):
        raise ValueError(f"prompt: {prompt_text[:40]!r} is not a {task!r} prompt ({spec.prefix}<s>=)")
    return spec.transform(prompt_text[len(spec.prefix) : -1])


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions), O(len(a) * len(b))."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _clean_completion(completion: str) -> str:
    # A completion decoded with special tokens kept ends at its first EOS; padding is not text.
    return completion.split(EOS_TOKEN, 1)[0].replace(PAD_TOKEN, "")


def string_match_reward(answer: str, completion: str) -> float:
    """1 - edit distance / the longer length: 1.0 exact, 0.0 empty, partial credit in between."""
    completion = _clean_completion(completion)
    longest = max(len(answer), len(completion))
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein(completion, answer) / longest


def _make_reward_fn(task: str) -> Callable[[str, str, dict], float]:
    def reward(prompt_text: str, completion_text: str, metadata: dict) -> float:
        return string_match_reward(reference_answer(task, prompt_text), completion_text)

    reward.__name__ = f"{task}_reward"
    reward.__doc__ = f"Reward of the built-in {task!r} task: string_match_reward against the answer."
    return reward


# Built-in reward functions by task name: fn(prompt_text, completion_text, metadata) -> float.
REWARD_FNS: dict[str, Callable[[str, str, dict], float]] = {name: _make_reward_fn(name) for name in _TASKS}


def score_task(task: str, prompt_text: str, completion_text: str, metadata: dict) -> float:
    """Reward of ``completion_text`` for ``prompt_text`` under the built-in ``task``."""
    if task not in REWARD_FNS:
        raise ValueError(f"task: no built-in reward for {task!r}; known: {', '.join(REWARD_FNS)}")
    return REWARD_FNS[task](prompt_text, completion_text, metadata)


def score(prompt: str, completion: str, metadata: dict) -> float:
    """Reward-server entry point (SDK signature): dispatches on ``metadata["task"]``.

    Run as a reward server: ``tailrace reward --connect ADDR --fn tailrace.engine.data.tasks:score``.
    """
    task = metadata.get("task", DEFAULT_TASK) if isinstance(metadata, dict) else DEFAULT_TASK
    if not isinstance(task, str):
        raise ValueError(f"metadata.task: must be a str, got {type(task).__name__}")
    return score_task(task, prompt, completion, metadata)


# What `tailrace reward --fn tailrace.engine.data.tasks:score` registers when --tasks is not given: only the
# tasks it can score, so that the trainer never sends it a task of the user's ("math") to fail.
score.tasks = TASK_NAMES
