"""A multi-turn environment for the shipped tiny model (it was trained to reverse strings): reverse a chain
of words, one per turn. The prompt asks for the first ("rev:abc="); after each assistant turn the
environment answers with the next word to reverse ("rev:defg="), and after the last one the episode is done.
Each turn is rewarded as it is answered, (1 - levenshtein(answer, reversed word) / length) / number of words,
and reset gives 0.0: the rewards of an episode sum to the mean similarity over the chain, and an episode cut
short (env.max_episode_tokens) still has the reward of the turns it answered (with one final reward only, it
would have none and wait for a reward server the run does not have: discarded as no_reward_server). It needs
as many turns as the chain has words, and the policy must read each observation to score.

Serve it: python -m tailrace.protocol.env_sdk examples.multiturn.reverse_chain:ReverseChain --connect ADDR
 or run: tailrace run --config examples/multiturn/config.toml   (starts it: env.server)
Data rows (examples/multiturn/prompts.jsonl): {"prompt": "rev:abc=", "words": "defg,hi"}; the trainer sends
the row's scalars as metadata. Test: pytest tests/engine/test_multiturn_example.py
"""

from __future__ import annotations


def levenshtein(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def similarity(answer: str, target: str) -> float:
    answer = answer.strip()
    longest = max(len(answer), len(target))
    return 1.0 - levenshtein(answer, target) / longest if longest else 1.0


class ReverseChain:
    """One instance per episode (the SDK makes it); reset and step return observations."""

    tasks = ("reverse_chain",)

    def reset(self, prompt: str, metadata: dict) -> dict:
        first = prompt.removeprefix("rev:").removesuffix("=")
        rest = [w for w in str(metadata.get("words", "")).split(",") if w]
        self.words = [first, *rest]
        self.turn = 0
        self.scores: list[float] = []
        return {"text": "", "reward": 0.0}  # the prompt already asks for the first word

    def step(self, action: str) -> dict:
        self.scores.append(similarity(action, self.words[self.turn][::-1]))
        self.turn += 1
        reward = self.scores[-1] / len(self.words)
        if self.turn == len(self.words):
            return {"done": True, "reward": reward,
                    "info": {"turns": self.turn, "mean_score": sum(self.scores) / len(self.scores)}}
        return {"text": f"rev:{self.words[self.turn]}=", "reward": reward, "info": {"score": self.scores[-1]}}
