"""The `train.algorithm = "dpo"` trainer: preference pairs from data.source, no generators, no reward servers.

    loop  take train.groups_per_step pairs (engine/data/dpo_pairs.py) -> reference log-probs (frozen initial
          policy, over the pairs' trie) -> DPO forward/backward by the branch-replay strategy (a pair's
          prompt runs once) -> clip, AdamW, LR schedule (Learner.apply_gradients) -> metrics.jsonl ->
          checkpoint every checkpoint.every_steps
    ends  at train.steps, when the data ends (data.epochs passes), or on SIGINT/SIGTERM/SIGHUP (after the step in progress): a last
          checkpoint (data position = rows consumed, so --resume continues at the next row) and summary.json
    ranks under torchrun (--nproc N): every rank reads the same pairs and runs the loop; DPOLearner gives each
          its share of a step's pairs; rank 0 owns the run folder (shared with the others), metrics and
          summary.json; a stop seen by any rank is agreed before each step; every rank joins the checkpoints

Run: tailrace trainer --config FILE --train.algorithm dpo --data.source pairs.jsonl (or `tailrace run`).
Test: pytest tests/engine/trainer/test_dpo.py
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import signal
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tailrace.engine.config import LoRAConfig, RunConfig, TrainConfig
from tailrace.engine.core import lifeline, models
from tailrace.engine.core.metrics import make_sink
from tailrace.engine.core.samples import TrainSample
from tailrace.engine.data.chat import adopt_template
from tailrace.engine.data.dpo_pairs import PairSource, PreferencePair
from tailrace.engine.replay import layered
from tailrace.engine.replay.dpo_loss import PAIR_STAT_KEYS, DPOLoss, pair_metrics, sequence_logprobs
from tailrace.engine.replay.trie import build_trie
from tailrace.engine.trainer import checkpoint, dist, ranks
from tailrace.engine.trainer.learner import Learner
from tailrace.engine.trainer.loss import LossNormaliser
from tailrace.engine.trainer.runs import make_run_dir

log = logging.getLogger("tailrace.trainer")


def pair_samples(pairs: Sequence[PreferencePair], policy_version: int) -> list[TrainSample]:
    """Pair i as samples 2i (chosen) and 2i + 1 (rejected), sharing the prompt. DPO reads no behaviour
    log-probs (zeros) and no reward; the policy version is the one being trained."""
    out = []
    for pair in pairs:
        for sample_id, ids in enumerate((pair.chosen_ids, pair.rejected_ids)):
            num = len(ids)
            out.append(TrainSample(group_id=pair.index, sample_id=sample_id, prompt_ids=pair.prompt_ids,
                                   completion_ids=ids, behaviour_logprobs=torch.zeros(num),
                                   policy_versions=torch.full((num,), policy_version), reward=0.0))
    return out


def _pair_cost(pair: PreferencePair) -> float:
    """What a pair costs a rank: its unique tokens (the prompt once)."""
    return float(build_trie(pair_samples([pair], 0)).num_unique_tokens)


class DPOLearner(Learner):
    """A Learner whose step takes preference pairs, with DPO's beta train.dpo_beta; the reference model is a
    frozen copy of the policy as given (so build it before loading a checkpoint into the policy).

    On several ranks (torchrun) every rank is given the same pairs and runs its share, whole pairs balanced
    by unique tokens as the GRPO learner shares groups; the loss is the mean over all ranks' pairs, so the
    summed gradients are one rank's. The reference model is sharded like the policy and its log-probs run
    in lock step too (train.fsdp.step_residency "layer"; "full" gathers each model whole for its pass)."""

    def __init__(self, model: nn.Module, config: TrainConfig, *, lora_config: LoRAConfig | None = None,
                 ref_model: nn.Module | None = None) -> None:
        if config.replay == "naive":
            raise ValueError("train.replay: dpo runs on the shared-prefix modes auto, replay or packed")
        if (config.ppo_epochs, config.minibatches) != (1, 1):
            raise ValueError("train.ppo_epochs, train.minibatches: dpo takes one optimizer step per batch of pairs")
        super().__init__(model, config, lora_config=lora_config,
                         ref_model=copy.deepcopy(model) if ref_model is None else ref_model)
        self.beta = config.dpo_beta

    def backward(self, pairs: Sequence[PreferencePair]) -> tuple[list[TrainSample], dict[str, torch.Tensor]]:
        """DPO gradients of `pairs` into the policy's .grad (zeroed first; reduced over ranks); the batch's
        samples and the strategy's statistics summed over ranks (DPOLoss's pair statistics included). Every
        rank calls it with the same pairs."""
        if not pairs:
            raise ValueError("pairs: empty batch")
        mine = pair_samples(dist.shard(pairs, _pair_cost, dist.rank(), dist.world_size()), self.policy_version)
        ref_S = self._ref_sequence_logprobs(mine)
        loss_fn = DPOLoss([(2 * i, 2 * i + 1) for i in range(len(mine) // 2)], ref_S, beta=self.beta,
                          num_pairs=len(pairs)) if mine else None
        samples = pair_samples(pairs, self.policy_version)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with dist.step_pass(self.model, self.config.fsdp, self._zero_weight_loss):
            stats = self._run_strategy(mine, loss_fn, LossNormaliser.from_samples(samples))
        return samples, dist.all_reduce_stats_(stats)

    def _ref_sequence_logprobs(self, samples: Sequence[TrainSample]) -> torch.Tensor:
        """Each of this rank's samples' summed completion log-prob under the reference model (float64 [S]).
        Every rank calls it, with samples or none: under per-layer residency the sharded reference runs its
        packs in lock step (layered.sample_logprobs), under "full" it is gathered whole for the pass."""
        chunk = self.config.logprob_chunk_tokens
        with dist.forward_only(self.ref_model, self.config.fsdp):
            if self._ref_lockstep is not None:
                per_sample = layered.sample_logprobs(self.ref_model, samples, self._ref_lockstep,
                                                     max_tokens=self.config.micro_batch_tokens, chunk_rows=chunk)
                if not per_sample:
                    return torch.zeros(0, dtype=torch.float64)
                return torch.stack([lp.sum() for lp in per_sample])
            if not samples:
                return torch.zeros(0, dtype=torch.float64)
            return sequence_logprobs(self.ref_model, samples, chunk)

    def step(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:  # type: ignore[override]
        """One optimizer step on a batch of pairs. Returns metrics named trainer/<group>/<name>."""
        with dist.rank_errors():
            return self._dpo_step(pairs)

    def _dpo_step(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        start_s = time.monotonic()
        samples, stats = self.backward(pairs)
        metrics = pair_metrics(stats)
        metrics.update({f"trainer/strategy/{k}": float(v) for k, v in stats.items()
                        if k not in PAIR_STAT_KEYS and k != "tokens"})
        metrics["trainer/tokens/logical"] = float(sum(s.num_tokens for s in samples))
        metrics["trainer/tokens/loss"] = float(sum(s.num_loss_tokens for s in samples))
        metrics.update(self.apply_gradients())
        metrics["trainer/time/step_s"] = time.monotonic() - start_s
        return metrics


class DPOTrainer:
    """Owns a DPO run: model, frozen reference, pair source, metrics sink and checkpoints (see module doc)."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, run_dir: Path | None = None):
        self.cfg = cfg
        if run_dir is None:
            run_dir = make_run_dir(cfg, resume) if dist.is_rank0() else None
        self.run_dir = ranks.share_run_dir(run_dir) if dist.world_size() > 1 else run_dir
        model_path = cfg.model.path or "tiny"
        self.tokenizer = models.load_tokenizer(model_path)
        adopt_template(cfg.data.chat_template, self.tokenizer)  # the checkpoints' tokenizer files carry it
        model = models.load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device)
        self.learner = DPOLearner(model, cfg.train, lora_config=cfg.model.lora)
        state: dict[str, Any] = {}
        if resume:
            folder = checkpoint.latest(self.run_dir / "checkpoint")
            if folder is None:
                raise ValueError(f"--resume: {self.run_dir}/checkpoint holds no complete checkpoint")
            state = checkpoint.load(folder, self.learner)
        counters = state.get("counters", {})
        self.source = PairSource(cfg.data, self.tokenizer, max_tokens=model.config.max_position_embeddings,
                                 position=state.get("data_position", {}).get("rows_consumed", 0))
        self.source.skipped_too_long = counters.get("pairs_skipped_too_long", 0)
        self.pairs_trained: int = counters.get("pairs_trained", 0)
        self.step_margins: list[float] = counters.get("step_reward_margins", [])
        self.step_accuracies: list[float] = counters.get("step_accuracies", [])
        self.token_totals = collections.Counter(counters.get("tokens", {}))
        self.busy_s_before = counters.get("trainer_busy_s", 0.0)
        self.wall_s_before = counters.get("wall_s", 0.0)
        self.busy_s = 0.0
        self.started_s = time.monotonic()
        self.stop_reason = ""
        self.sink = make_sink(self.run_dir if dist.is_rank0() else None, cfg)

    def request_stop(self, signum: int, _frame: Any = None) -> None:
        if not self.stop_reason:
            self.stop_reason = lifeline.stop_reason(signum)
            log.info("stopping after this step: %s", self.stop_reason)

    def run(self) -> dict[str, Any]:
        stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, self.request_stop) for sig in stops}
        try:
            self.train_loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.finish()

    def stopping(self) -> bool:
        """Whether to stop before the next step. On several ranks a signal seen by any rank stops all of them
        after the same step (agreed: one all-reduce per step)."""
        if dist.world_size() > 1 and dist.agree_max([int(bool(self.stop_reason))])[0] and not self.stop_reason:
            self.stop_reason = "stopped by another trainer rank"
        return bool(self.stop_reason)

    def train_loop(self) -> None:
        total = self.cfg.train.steps
        while self.learner.step_count < total and not self.stopping():
            pairs = self.source.take(self.cfg.train.groups_per_step)
            if not pairs:
                self.stop_reason = f"no more pairs: {self.source.exhausted_text()}"
                break
            self.train_step(pairs)
        if self.learner.step_count >= total:
            self.stop_reason = self.stop_reason or f"reached train.steps = {total}"

    def train_step(self, pairs: list[PreferencePair]) -> None:
        started = time.monotonic()
        metrics = self.learner.step(pairs)
        self.busy_s += time.monotonic() - started
        self.pairs_trained += len(pairs)
        self.step_margins.append(metrics["trainer/dpo/reward_margin"])
        self.step_accuracies.append(metrics["trainer/dpo/accuracy"])
        for key in ("logical_tokens", "unique_tokens"):
            self.token_totals[key] += metrics.get(f"trainer/strategy/{key}", 0.0)
        metrics |= {"trainer/data/rows_consumed": self.source.position,
                    "trainer/data/epochs_done": self.source.position // max(1, self.source.num_rows),
                    "trainer/data/pairs_skipped_too_long": self.source.skipped_too_long,
                    "trainer/time/elapsed_s": self.wall_s_before + time.monotonic() - self.started_s}
        step = self.learner.step_count
        self.sink.log(step, metrics)
        if dist.is_rank0():
            log.info("step %d/%d dpo loss %.4f margin %.4f accuracy %.2f", step, self.cfg.train.steps,
                     metrics["trainer/dpo/loss"], metrics["trainer/dpo/reward_margin"],
                     metrics["trainer/dpo/accuracy"])
        every = self.cfg.checkpoint.every_steps
        if every and step % every == 0:
            self.save_checkpoint()

    def save_checkpoint(self) -> Path:
        return checkpoint.save(self.run_dir / "checkpoint", self.learner,
                               data_position={"rows_consumed": self.source.position}, counters=self.summary(),
                               tokenizer=self.tokenizer, keep_last=self.cfg.checkpoint.keep)

    def summary(self) -> dict[str, Any]:
        """Like a GRPO run's summary.json; the DPO figures take the place of rewards (first/last: means of
        the first and last tenth of the steps)."""
        n = max(1, len(self.step_margins) // 10)
        tokens = self.token_totals
        return {
            "algorithm": "dpo",
            "steps": self.learner.step_count,
            "policy_version": self.learner.policy_version,
            "pairs_trained": self.pairs_trained,
            "pairs_skipped_too_long": self.source.skipped_too_long,
            "rows_consumed": self.source.position,
            "reward_margin_first": statistics.fmean(self.step_margins[:n]) if self.step_margins else None,
            "reward_margin_last": statistics.fmean(self.step_margins[-n:]) if self.step_margins else None,
            "accuracy_first": statistics.fmean(self.step_accuracies[:n]) if self.step_accuracies else None,
            "accuracy_last": statistics.fmean(self.step_accuracies[-n:]) if self.step_accuracies else None,
            "step_reward_margins": self.step_margins,
            "step_accuracies": self.step_accuracies,
            "trainer_busy_s": self.busy_s_before + self.busy_s,
            "tokens": dict(tokens),  # logical: sum over samples; unique: what ran forward
            "replay_saving": tokens["logical_tokens"] / tokens["unique_tokens"] if tokens["unique_tokens"] else None,
            "wall_s": self.wall_s_before + time.monotonic() - self.started_s,
            "stop_reason": self.stop_reason,
        }

    def finish(self) -> dict[str, Any]:
        folder = self.save_checkpoint()
        summary = self.summary() | {"checkpoint": str(folder.parent / checkpoint.LATEST)}
        if dist.is_rank0():
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.sink.close()
        return summary
