"""Entry point of `tailrace trainer`: parse the config, then import torch and run the trainer service.

Run: tailrace trainer [--config FILE] [--train.steps 10] [--resume]
Under torchrun every rank builds the learner; rank 0 alone speaks the protocol. With
train.algorithm = "dpo" the trainer trains on preference pairs alone (engine/trainer/dpo.py).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from tailrace.engine import preflight, report
from tailrace.engine.config import load_config


def main(args: Any, overrides: list[str], *, make_learner: Any = None) -> int:
    """make_learner: TrainerService's seam (engine/trainer/service.py LearnerFactory); None is Learner."""
    cfg = load_config(args.config, overrides)
    preflight.check_model_path(cfg.model.path)
    if cfg.train.algorithm != "dpo":
        preflight.check_bind_free(cfg.trainer.bind)
    if not cfg.trainer.run_name:  # named here, so that a failed start can remove the folder it made
        cfg.trainer.run_name = time.strftime("run-%Y%m%d-%H%M%S")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    import torch

    from tailrace.engine.trainer import dist
    from tailrace.engine.trainer.service import TrainerService
    from tailrace.protocol.transport import run

    torch.set_num_threads(cfg.launch.torch_threads)
    info = dist.init_from_env()
    if info.world_size > 1:
        raise ValueError("multi-rank training is not wired into the trainer service yet: run one rank "
                         "(the learner and engine/trainer/dist.py are ready for it)")
    with preflight.removed_if_start_fails(Path(cfg.trainer.runs_dir) / cfg.trainer.run_name):
        if cfg.train.algorithm == "dpo":  # preference pairs from data.source: no peers, no protocol
            from tailrace.engine.trainer.dpo import DPOTrainer

            role = DPOTrainer(cfg, resume=args.resume)
        else:
            role = TrainerService(cfg, resume=args.resume, make_learner=make_learner)
    summary = role.run() if cfg.train.algorithm == "dpo" else run(role.run())
    print(f"tailrace trainer: {report.summary_line(summary)}")
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))  # last: for scripts
    return 0
