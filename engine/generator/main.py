"""Entry point of `tailrace generator`: parse the config, then import torch and run the generator.

Run: tailrace generator --connect tcp://127.0.0.1:5555 [--config FILE] [--generator.max_batch_size 16]
Started before its trainer, it waits for one (saying so every few seconds), for --connect-timeout-s
seconds or, by default, until the trainer comes up.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

from tailrace.engine.config import load_config
from tailrace.engine.core import preflight, report


def main(args: Any, overrides: list[str], *, make_backend: Any = None) -> int:
    """make_backend: GeneratorService's seam (engine/generator/interface.py BackendFactory); None builds
    the backend generator.backend names."""
    cfg = load_config(args.config, overrides)
    preflight.check_model_path(cfg.model.path)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s generator %(levelname)s %(message)s")
    import torch

    from tailrace.engine.generator.service import GeneratorService
    from tailrace.protocol.transport import ConnectionLost, ConnectTimeout, Rejected, read_key, run

    torch.set_num_threads(cfg.launch.torch_threads)
    service = GeneratorService(cfg, args.connect, name=args.name,
                               curve_server_key=read_key(args.curve_server_key, "--curve-server-key"),
                               curve_secret_key=read_key(args.curve_key, "--curve-key"), make_backend=make_backend,
                               connect_for_s=args.connect_timeout_s or math.inf)
    try:
        reason = run(service.run())
    except (ConnectTimeout, Rejected) as exc:
        print(report.connect_failed("generator", args.connect, exc, args.connect_timeout_s), file=sys.stderr)
        return 1
    except ConnectionLost as exc:
        print(f"tailrace generator: lost the trainer at {args.connect}: {exc}", file=sys.stderr)
        return 1
    logging.getLogger("tailrace.generator").info("stopped: %s", reason)
    return 0
