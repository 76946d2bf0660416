"""Entry point of `tailrace trainer`: parse the config, then import torch and run the trainer service.

Run: tailrace trainer [--config FILE] [--train.steps 10] [--resume]
Under torchrun every rank builds the learner; rank 0 alone speaks the protocol. With
train.algorithm = "dpo" the trainer trains on preference pairs alone (engine/trainer/dpo.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tailrace.engine.config import load_config


def main(args: Any, overrides: list[str], *, make_learner: Any = None) -> int:
    """make_learner: TrainerService's seam (engine/trainer/service.py LearnerFactory); None is Learner."""
    cfg = load_config(args.config, overrides)
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
    if cfg.train.algorithm == "dpo":  # preference pairs from data.source: no peers, no protocol
        from tailrace.engine.trainer.dpo import DPOTrainer

        summary = DPOTrainer(cfg, resume=args.resume).run()
    else:
        summary = run(TrainerService(cfg, resume=args.resume, make_learner=make_learner).run())
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))  # not the per-step lists
    return 0
