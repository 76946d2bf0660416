"""Entry point of `tailrace trainer`: parse the config, then import torch and run the trainer service.

Run: tailrace trainer [--config FILE] [--train.steps 10] [--resume] [--nproc N]
--nproc N > 1 re-executes itself under `torchrun --standalone --nproc-per-node N`; under torchrun every
rank builds the (FSDP2-sharded) learner, rank 0 alone speaks the protocol and the others follow it
(engine/trainer/ranks.py). With train.algorithm = "dpo" the trainer trains on preference pairs alone
(engine/trainer/dpo_loop.py); under torchrun every rank runs that loop on its share of each step's pairs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tailrace.engine.config import RunConfig, config_data, from_dict, resumed_data
from tailrace.engine.core import preflight, report, run_lock
from tailrace.engine.data import checks


def torchrun_argv(nproc: int, args: Any, overrides: list[str]) -> list[str]:
    """This trainer's command line under torchrun on one node (torchrun reports a rank that dies)."""
    own = ["--config", args.config] if args.config else []
    own += ["--resume"] if args.resume else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", "-m", "tailrace.engine.cli", "trainer", *own, *overrides]


def main(args: Any, overrides: list[str], *, make_learner: Any = None) -> int:
    """make_learner: TrainerService's seam (engine/trainer/service.py LearnerFactory); None is Learner."""
    data = config_data(args.config, overrides)
    if args.resume:  # the run's own config.toml under the settings given here
        data, _ = resumed_data(data)
    cfg = from_dict(RunConfig, data)
    nproc = getattr(args, "nproc", 1)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        argv = torchrun_argv(nproc, args, overrides)
        os.execv(argv[0], argv)
    preflight.check_model_path(cfg.model.path)
    if not cfg.trainer.run_name:  # named here, so that a failed start can remove the folder it made
        cfg.trainer.run_name = time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = Path(cfg.trainer.runs_dir) / cfg.trainer.run_name
    if cfg.train.algorithm != "dpo":
        preflight.check_port_unclaimed(Path(cfg.trainer.runs_dir), cfg.trainer.bind, run_dir)
        preflight.check_bind_free(cfg.trainer.bind)
        checks.check_prompts(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    import torch

    from tailrace.engine.trainer import dist

    torch.set_num_threads(cfg.launch.torch_threads)
    info = dist.init_from_env(timeout_s=cfg.train.fsdp.collective_timeout_s)
    fresh = not run_dir.exists()
    with preflight.removed_if_start_fails(run_dir):
        if info.rank == 0:  # one run per run folder; held until this process exits (tailrace run's: by it)
            run_lock.take(run_dir, bind=cfg.trainer.bind)
        if cfg.train.algorithm == "dpo":  # preference pairs from data.source: no peers, no protocol
            from tailrace.engine.trainer.dpo_loop import DPOTrainer

            role = DPOTrainer(cfg, resume=args.resume)
        elif info.world_size == 1:
            from tailrace.engine.trainer.service import TrainerService

            role = TrainerService(cfg, resume=args.resume, make_learner=make_learner)
    from tailrace.engine.trainer.writes import WriteFailed
    from tailrace.protocol.transport import BindFailed, run

    try:
        if cfg.train.algorithm == "dpo":
            summary = role.run()
            if info.world_size > 1:
                dist.shutdown()
                summary = summary if info.rank == 0 else None
        elif info.world_size > 1:
            summary = _run_ranks(cfg, args.resume, make_learner, info.rank)
            dist.shutdown()
        else:
            summary = run(role.run())
    except BindFailed as exc:  # the port went between the preflight check and the bind: nothing ran yet
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise ValueError(f"trainer.bind: {exc}; pick another port, or port 0 for a free one") from None
    except WriteFailed:  # a full disk: already said in one line on stderr, and to the peers
        return 1
    if summary is not None:
        print(f"tailrace trainer: {report.summary_line(summary)}")
        print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))  # last: for scripts
    return 0


def _run_ranks(cfg: Any, resume: bool, make_learner: Any, rank: int) -> dict | None:
    """Rank 0: the service with a Leader learner; the others: the same learner, following rank 0."""
    from tailrace.engine.core import models
    from tailrace.engine.trainer import checkpoint, ranks
    from tailrace.engine.trainer.learner import Learner
    from tailrace.engine.trainer.runs import make_run_dir

    make = make_learner or Learner
    if rank == 0:
        from tailrace.engine.trainer.service import TrainerService
        from tailrace.protocol.transport import run

        run_dir = ranks.share_run_dir(make_run_dir(cfg, resume))
        leaders: list[ranks.Leader] = []

        def leading(*a: Any, **k: Any) -> ranks.Leader:
            leaders.append(ranks.Leader(make(*a, **k)))
            return leaders[-1]

        try:
            return run(TrainerService(cfg, resume=resume, run_dir=run_dir, make_learner=leading).run())
        finally:
            if leaders:  # the followers stop too (also when rank 0 fails: its exit code tells torchrun)
                leaders[0].close()
    # rank 0 decides when to stop (after its final checkpoint, which needs every rank): signals that
    # torchrun forwards to all ranks must not end a follower first.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    run_dir = ranks.share_run_dir(None)
    path = cfg.model.path or "tiny"
    model = models.load_model(path, dtype=cfg.model.dtype, device=cfg.model.device).train()
    ref = models.load_model(path, dtype=cfg.model.dtype, device=cfg.model.device) if cfg.train.kl_coef > 0 else None
    learner = make(model, cfg.train, lora_config=cfg.model.lora, ref_model=ref)
    latest = checkpoint.latest(run_dir / "checkpoint") if resume else None
    if latest is not None:
        checkpoint.load(latest, learner)
    ranks.follow(learner, checkpoint.save)
    return None
