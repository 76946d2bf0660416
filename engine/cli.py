"""The `tailrace` command: one subcommand per process role, plus `run` (all roles on this machine).

    tailrace run [--config FILE] [--section.name VALUE ...]
    tailrace trainer --config FILE [--resume] [--nproc N] [--section.name VALUE ...]
    tailrace generator --connect ADDR [--name NAME] [--config FILE] [--section.name VALUE ...]
    tailrace reward --connect ADDR --fn module:function [--tasks a,b] [--max-concurrency N]
    tailrace reward --connect ADDR --config FILE [--reward.functions ...]   the weighted sum of reward.functions
    tailrace eval --checkpoint DIR [--config FILE] [--fn module:function] [--json] [--section.name VALUE ...]
    tailrace config [--config FILE] [--section.name VALUE ...]   every setting, resolved, with its default
    tailrace samples RUN_DIR [--step N] [--last K] [--json]      completions of a run's steps as text
    tailrace plan --model DIR_OR_CONFIG [--ranks W] [--tokens N] [--device-gb G] [--json]   per-rank memory
    tailrace --version

Parsing happens here, before any heavy import (torch, transformers): each role's `main` imports
what it needs. A process started by `tailrace run` first arranges to stop when its launcher dies
(engine/core/lifeline.py). Test: pytest tests/engine/test_user_path.py
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

OVERRIDES_HELP = ("settings override the config file as dotted names, e.g. --train.lr 1e-4 "
                  "--sampling.group_size 8 (docs/configuration.md lists them)")
SETTINGS_EPILOG = ("settings: `tailrace config [--config FILE] [--section.name VALUE ...]` prints every one, "
                   "resolved, with its meaning and default")
CONNECT_TIMEOUT_HELP = ("how long to wait for the trainer to answer, saying so every 10 s; "
                        "0 (default) = until it comes up")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tailrace")
    except PackageNotFoundError:
        return "0+unknown"


def _peer_arguments(role: argparse.ArgumentParser) -> None:
    """What every role that connects to a trainer takes: CURVE keys and how long to wait for it."""
    role.add_argument("--curve-server-key", default="", help="file with the trainer's CURVE public key")
    role.add_argument("--curve-key", default="", help="file with this client's CURVE secret key (default: a new one)")
    role.add_argument("--connect-timeout-s", type=float, default=0.0, help=CONNECT_TIMEOUT_HELP)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tailrace",
        description="Async streaming rollout-and-train engine for RL post-training of language models.",
    )
    parser.add_argument("--version", action="version", version=f"tailrace {_version()}")
    sub = parser.add_subparsers(dest="role", required=True,
                                metavar="{run,trainer,generator,reward,env,eval,config,samples,plan}")

    run = sub.add_parser("run", help="trainer, generators and a reward server on this machine", epilog=SETTINGS_EPILOG,
                         description="Start a trainer, launch.num_generators generators and a reward "
                         "server for the built-in tasks (none with reward.mode servers) as separate processes over loopback, show progress, stop cleanly on "
                         "Ctrl-C, SIGTERM or SIGHUP with a checkpoint. One run per run folder: another run "
                         "on the same trainer.run_name is refused while this one runs. "
                         "Where nothing started scores data.task, it prints how to attach your reward server. "
                         + OVERRIDES_HELP)
    run.add_argument("--config", help="TOML run config (default: built-in defaults, the shipped tiny model)")
    run.add_argument("--resume", action="store_true", help="continue the run named by trainer.run_name from its last "
                     "checkpoint, with its settings (runs/<name>/config.toml) under those given here")
    run.add_argument("--no-progress", action="store_true", help="no progress output (bars on a terminal, else a line per step)")

    trainer = sub.add_parser("trainer", help="the trainer: binds the endpoints and owns the run", epilog=SETTINGS_EPILOG,
                             description="Bind the protocol endpoints (trainer.bind), hand out work, "
                             "score, train, publish weights, checkpoint. " + OVERRIDES_HELP)
    trainer.add_argument("--config", help="TOML run config")
    trainer.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint, "
                         "with its settings (runs/<name>/config.toml) under those given here")
    trainer.add_argument("--nproc", type=int, default=1,
                         help="trainer ranks on this machine: starts torchrun, FSDP2-sharded (default 1)")

    gen = sub.add_parser("generator", help="a sampler on the backend generator.backend names (torch by default)", epilog=SETTINGS_EPILOG,
                         description="Connect to a trainer, pull work, stream finished samples, take new "
                         "weights between decode steps. " + OVERRIDES_HELP)
    gen.add_argument("--connect", required=True, help="trainer address, e.g. tcp://127.0.0.1:5555")
    gen.add_argument("--name", default="", help="unique name in the run (default: gen-<pid>)")
    gen.add_argument("--config", help="TOML run config (model, generator and sampling sections apply)")
    _peer_arguments(gen)

    reward = sub.add_parser("reward", help="serve a Python reward function",
                            description="Run `module:function` (score(prompt, completion, metadata) -> "
                            "float | dict) as a reward server attached to a trainer; without --fn, the "
                            "weighted sum of reward.functions (--config FILE or --reward.functions "
                            "mod:f,mod:g=0.5), each function's value logged under its name.")
    reward.add_argument("--connect", required=True, help="trainer address, e.g. tcp://127.0.0.1:5555")
    reward.add_argument("--fn", default="", help="module:function, e.g. tailrace.engine.data.tasks:score")
    reward.add_argument("--config", help="TOML run config whose reward.functions it serves (without --fn)")
    reward.add_argument("--tasks", default="", help="comma-separated task names it scores (default: the "
                        "function's `tasks` attribute if it has one, else all)")
    reward.add_argument("--name", default="", help="unique name in the run (default: reward-<pid>)")
    reward.add_argument("--max-concurrency", type=int, default=16, help="requests served at once")
    reward.add_argument("--timeout-s", type=float, default=30.0, help="per-request time limit")
    _peer_arguments(reward)

    env = sub.add_parser("env", help="serve a Python environment class (multi-turn episodes)",
                         description="Run `module:Class` as an environment server attached to a trainer: one "
                         "instance per episode, reset(prompt, metadata) then step(action) per assistant turn, "
                         "each returning an observation (docs/environments.md).")
    env.add_argument("env", metavar="MODULE:CLASS", help="e.g. examples.multiturn.reverse_chain:ReverseChain")
    env.add_argument("--connect", required=True, help="trainer address, e.g. tcp://127.0.0.1:5555")
    env.add_argument("--tasks", default="", help="comma-separated task names it serves (default: the class's "
                     "`tasks` attribute if it has one, else all)")
    env.add_argument("--name", default="", help="unique name in the run (default: env-<host>-<pid>)")
    env.add_argument("--max-concurrency", type=int, default=16, help="resets and steps served at once")
    env.add_argument("--max-episodes", type=int, default=1024, help="episodes open at once")
    env.add_argument("--timeout-s", type=float, default=60.0, help="per-request time limit")
    _peer_arguments(env)

    evaluate = sub.add_parser("eval", help="evaluate a saved checkpoint: greedy accuracy, mean reward, pass@k",
                              epilog=SETTINGS_EPILOG, description="Load a checkpoint folder, sample the eval "
                              "prompts (eval.source, eval.num_prompts: one greedy sample and eval.n at "
                              "eval.temperature each, seeded), score them with the built-in task functions or "
                              "--fn, print one line (and, with --json, a JSON line). Settings: the run's "
                              "config.toml (runs/<name>/, above checkpoint/), then --config. " + OVERRIDES_HELP)
    evaluate.add_argument("--checkpoint", required=True,
                          help="runs/<name>/checkpoint/latest or .../step_NNNNNN (what from_pretrained loads)")
    evaluate.add_argument("--config", help="TOML run config over the run's own (eval, data, sampling sections apply)")
    evaluate.add_argument("--fn", default="", help="module:function that scores the prompts' tasks, as "
                          "`tailrace reward --fn` would (default: the built-in task functions)")
    evaluate.add_argument("--json", action="store_true", help="also print the figures as one JSON line, last")

    config = sub.add_parser("config", help="print every setting, resolved, with its meaning and default",
                            description="Print the config that `--config FILE` and the overrides resolve to, as "
                            "TOML that --config reads back: every setting with its meaning, and its default where "
                            "it differs. " + OVERRIDES_HELP)
    config.add_argument("--config", help="TOML run config")

    samples = sub.add_parser("samples", help="print the completions a run trained on, with prompts and rewards",
                             description="Print the completions that a run wrote to RUN_DIR/samples.jsonl "
                             "(metrics.samples_per_step per step, default 4): step, group, sample, its reward "
                             "beside its group's rewards (all equal: the group taught nothing), the policy "
                             "versions that sampled it, its length and why it ended, then the prompt and the "
                             "completion as the reward saw them. Works while the run goes on.")
    samples.add_argument("run", metavar="RUN_DIR", help="the run folder, runs/<name> (or its samples.jsonl)")
    samples.add_argument("--step", type=int, default=None, metavar="N", help="only the samples of step N")
    samples.add_argument("--last", type=int, default=1, metavar="K",
                         help="the samples of the last K steps written (default 1)")
    samples.add_argument("--json", action="store_true", help="one JSON object per sample, as in samples.jsonl")
    _plan_parser(sub)
    parser.set_defaults(role_parsers=sub.choices)  # for a role's own usage on a bad flag
    return parser


def _plan_parser(sub: Any) -> None:
    plan = sub.add_parser("plan", help="predict a training step's per-rank peak memory from a model's config",
                          description="Predict each rank's peak memory in a training step from a model's config "
                          "alone (built on the meta device: nothing downloaded or allocated): sharded weights, "
                          "AdamW moments, gradients, gathered parameters per residency (layer: one decoder layer "
                          "at a time; full: the whole model for the step), activations of a micro-batch of "
                          "--tokens with and without activation checkpointing, the LM head's chunk; and the most "
                          "tokens per micro-batch that fit in --device-gb. docs/scaling.md, Memory plan.")
    plan.add_argument("--model", required=True, help="checkpoint folder or config.json (e.g. "
                      "examples/configs/qwen2.5-7b); only the config is read")
    plan.add_argument("--ranks", type=int, default=1, help="trainer ranks, FSDP2-sharded (default 1)")
    plan.add_argument("--tokens", type=int, default=4096,
                      help="padded tokens per micro-batch on each rank, train.micro_batch_tokens (default 4096)")
    plan.add_argument("--residency", choices=("layer", "full"), default=None,
                      help="train.fsdp.step_residency to show (default: both)")
    plan.add_argument("--param-dtype", default="float32",
                      help="model.dtype: master weights, gradients, AdamW moments (default float32)")
    plan.add_argument("--compute-dtype", default="bfloat16", help="gathered weights and activations, "
                      "train.fsdp.mixed_precision: bfloat16 (bf16, CUDA's auto) or the param dtype (off)")
    plan.add_argument("--cpu-offload", action="store_true", help="train.fsdp.cpu_offload")
    plan.add_argument("--lora-r", type=int, default=0, help="model.lora.r: > 0 trains only the adapters")
    plan.add_argument("--lora-targets", default="q_proj,v_proj", help="model.lora.target_modules, comma-separated")
    plan.add_argument("--logprob-chunk-tokens", type=int, default=1024, help="train.logprob_chunk_tokens")
    plan.add_argument("--row-tokens", type=int, default=0, help="rows padded to this many tokens: a padding "
                      "mask, which SDPA keeps per layer, and repeated KV heads; 0 (default): no padding")
    plan.add_argument("--logits-impl", choices=("triton", "torch"), default="triton",
                      help="the LM head's kernels: triton (CUDA, default) or torch (CPU)")
    plan.add_argument("--device-gb", type=float, default=80.0, help="memory per device, GB (default 80)")
    plan.add_argument("--reserve-gb", type=float, default=4.0, help="of it kept for the CUDA context, NCCL and "
                      "allocator fragmentation, which the plan does not model (default 4)")
    plan.add_argument("--json", action="store_true", help="the plan as one JSON object")


def _set_title(role: str) -> None:
    try:
        import setproctitle  # optional
    except ImportError:
        return
    setproctitle.setproctitle(f"tailrace-{role}")


def _bad_override(overrides: list[str]) -> str | None:
    """What is wrong with the first flag among the overrides that names no setting, or None."""
    from tailrace.engine.config import setting_names

    known = setting_names()
    for arg in overrides:
        if arg.startswith("--") and arg.partition("=")[0][2:] not in known:
            name = arg.partition("=")[0]
            return (f"unrecognized argument {name}" if "." not in name else
                    f"unknown setting {name} (`tailrace config` lists them)")
    return None


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(the role's arguments, its dotted config overrides) of a `tailrace` command line. A flag that is
    neither the role's own nor a setting gets the role's usage and one line."""
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    role_parser = args.role_parsers[args.role]
    if args.role in ("samples", "plan", "env") and overrides:
        role_parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.role == "reward" and args.fn and overrides:
        role_parser.error(f"unrecognized arguments: {' '.join(overrides)} (settings go with reward.functions, not --fn)")
    problem = _bad_override(overrides)
    if problem is not None:
        role_parser.error(problem)
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    from tailrace.engine.core import lifeline

    lifeline.follow_launcher()  # a child of `tailrace run` stops when the launcher dies, also by kill -9
    args, overrides = parse_args(argv)
    _set_title(args.role)
    try:
        if args.role == "run":
            from tailrace.engine.launch import main as role_main
        elif args.role == "trainer":
            from tailrace.engine.trainer.main import main as role_main
        elif args.role == "generator":
            from tailrace.engine.generator.main import main as role_main
        elif args.role == "eval":
            from tailrace.engine.eval.main import main as role_main
        elif args.role == "samples":
            from tailrace.engine.trainer.sample_log import main as role_main
        elif args.role == "plan":
            from tailrace.engine.trainer.plan import main as role_main
        elif args.role == "env":
            from tailrace.protocol.env_sdk import run_args

            return run_args(args)
        elif args.role == "config":
            from tailrace.engine.config import commented_toml, load_config

            print(commented_toml(load_config(args.config, overrides)), end="")
            return 0
        else:
            from tailrace.engine.reward_server import main as role_main
        return role_main(args, overrides) or 0
    except ValueError as exc:  # bad user input: one clear line, no traceback
        print(f"tailrace {args.role}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or a stop signal during `tailrace run`'s start-up
        return 128 + getattr(exc, "signum", 2)


if __name__ == "__main__":
    sys.exit(main())
