"""Branch-replay: exact shared-prefix training over the prefix trie of a step's samples.

    trie.py       the trie of token ids: segments, path depths, loss rows (branching tokens included)
    forward.py    functional forward of the supported families: cached path prefix, tree mask
    attention.py  exact attention over trie paths (CPU flash kernels, split-KV backward)
    replay.py     `replay`: depth-first, each segment once, prefix gradients restored (the default mode)
    packed.py     `packed`: whole tries as one sequence with a tree mask; `auto` picks one of the two
    layer_major.py `layer_major`: every segment through layer l before l+1, so each FSDP2 layer gathers and
                  reduces once per micro-batch in the same order on every rank (per-layer sharding)
    dpo_loss.py   DPO's loss over a chosen/rejected pair sharing its prompt

STRATEGIES maps train.replay's names to factories from the train config (engine/config.py TrainConfig). This package imports
nothing of engine/trainer (the loss types it shares with the learner are in engine/core/losses.py), so the
learner imports it directly. Test: pytest tests/engine/replay/test_trie.py tests/engine/replay/test_replay.py
tests/engine/replay/test_layer_major.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tailrace.engine.replay.layer_major import LayerMajorForwardBackward
from tailrace.engine.replay.packed import AutoForwardBackward, PackedForwardBackward
from tailrace.engine.replay.replay import ReplayForwardBackward


def _replay(config: Any) -> ReplayForwardBackward:
    return ReplayForwardBackward(config.logprob_chunk_tokens, config.log_entropy,
                                 max_batch_tokens=config.micro_batch_tokens)


def _packed(config: Any) -> PackedForwardBackward:
    return PackedForwardBackward(config.micro_batch_tokens, config.logprob_chunk_tokens, config.log_entropy)


def _auto(config: Any) -> AutoForwardBackward:
    return AutoForwardBackward(_replay(config), _packed(config))


def _layer_major(config: Any) -> LayerMajorForwardBackward:
    return LayerMajorForwardBackward(config.logprob_chunk_tokens, config.log_entropy,
                                     max_unit_tokens=config.micro_batch_tokens,
                                     reshard_after_forward=config.fsdp.reshard_after_forward)


STRATEGIES: dict[str, Callable[[Any], Any]] = {"replay": _replay, "packed": _packed, "auto": _auto,
                                               "layer_major": _layer_major}
"""train.replay -> factory(TrainConfig) -> ForwardBackward."""
