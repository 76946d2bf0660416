"""Checkpoints that resume a run exactly and that `transformers` loads as a model.

    ROOT/step_000012/  dcp/ (torch.distributed.checkpoint: model + optimizer, sharded, one file per rank),
                       config.json, model*.safetensors (save_pretrained of the full model, for transformers;
                       with LoRA the merged weights, and adapter/ for peft: engine/trainer/lora.py),
                       tokenizer files (if given), scheduler.pt, rng_rank{R}.pt, trainer_state.json (last)
    ROOT/latest        a relative symlink to the newest step_N: from_pretrained("ROOT/latest") loads it

Every rank calls save and load. DCP stores each tensor's shards with their global layout, so a checkpoint
saved on N ranks resumes on M (2 -> 1, 1 -> 2). A checkpoint is written into ROOT/.tmp-step_N and
renamed into place, so a crash never leaves a half-written step_N; only the newest `keep_last` are kept.
The .pt files are our own local files, never network input, and are still read with weights_only=True.
Test: pytest tests/engine/trainer/test_checkpoint.py tests/engine/trainer/test_dist.py
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tailrace.engine.trainer import dist, lora, ranks
from tailrace.engine.trainer.learner import Learner
from tailrace.engine.trainer.writes import WriteFailed, os_error

PREFIX = "step_"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 2
DCP_DIR = "dcp"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save(
    root: str | os.PathLike,
    learner: Learner,
    *,
    data_position: dict[str, Any],
    counters: dict[str, Any] | None = None,
    tokenizer: Any = None,
    keep_last: int = 3,
) -> Path:
    """Write the learner's full state as ROOT/step_<learner.step_count>; every rank calls this.

    data_position: the caller's opaque, JSON-serialisable position in its data (restored verbatim).
    counters: other JSON-serialisable run counters (samples trained, discards by reason, ...).
    Returns the checkpoint folder. A save that fails leaves no ROOT/.tmp-step_N; an OSError (a full disk)
    is raised as WriteFailed naming the path, `latest` still pointing at the last complete checkpoint.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last: must be >= 1, got {keep_last}")
    root = Path(root)
    learner = ranks.for_all_ranks(learner, root, keep_last)  # rank 0 of several: the others join the save
    final = root / checkpoint_name(learner.step_count)
    tmp = root / f".tmp-{final.name}"
    try:
        _save(learner, root, tmp, final, data_position, counters, tokenizer, keep_last)
    except BaseException as exc:
        if dist.is_rank0():  # no partial checkpoint stays behind to keep a full disk full
            shutil.rmtree(tmp, ignore_errors=True)
        error = os_error(exc)
        if error is None:
            raise
        raise WriteFailed(tmp, error) from exc
    return final


def _save(learner: Learner, root: Path, tmp: Path, final: Path, data_position: dict[str, Any],
          counters: dict[str, Any] | None, tokenizer: Any, keep_last: int) -> None:
    if dist.is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save
        tmp.mkdir()
    dist.barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{dist.rank()}.pt")
    _dcp(dcp.save, _dcp_state(learner), tmp / DCP_DIR)
    full = dist.gather_full_state_dict(learner.model) if dist.world_size() > 1 else None  # a collective
    if dist.is_rank0():
        if learner.lora is None:
            learner.model.save_pretrained(tmp, state_dict=full)
        else:  # the merged weights transformers loads, the adapter peft loads
            lora.save(learner.lora, learner.model, tmp, full)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(learner.scheduler.state_dict(), tmp / "scheduler.pt")
    dist.barrier()  # every rank's files are in tmp before it becomes visible
    if dist.is_rank0():
        trainer_state = {
            "format_version": FORMAT_VERSION,
            "step": learner.step_count,
            "policy_version": learner.policy_version,
            "data_position": data_position,
            "counters": counters or {},
            "world_size": dist.world_size(),
            "saved_wall_s": time.time(),
        }
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
        _replace_dir(tmp, final)
        _point_latest(root, final.name)
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    dist.barrier()


def _point_latest(root: Path, name: str) -> None:
    """ROOT/latest -> name, replaced atomically (a reader sees the old or the new checkpoint, never none)."""
    tmp = root / f".tmp-{LATEST}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name, target_is_directory=True)
    os.replace(tmp, root / LATEST)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename src to dst; an existing dst (the same step saved twice) is moved aside first, then removed."""
    if dst.exists():
        trash = dst.with_name(f".old-{dst.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(dst, trash)
        os.replace(src, dst)
        shutil.rmtree(trash)
    else:
        os.replace(src, dst)


def load(folder: str | os.PathLike, learner: Learner) -> dict[str, Any]:
    """Restore model weights, optimizer, scheduler, counters and this rank's RNG into `learner`.

    The learner must be built with the same model architecture and config. Returns trainer_state.json.
    """
    folder = Path(folder)
    state_path = folder / STATE_FILE
    if not state_path.is_file():
        raise ValueError(f"checkpoint: {folder} is not a complete checkpoint (no {STATE_FILE})")
    trainer_state = json.loads(state_path.read_text())
    if trainer_state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint: format_version {trainer_state.get('format_version')} != {FORMAT_VERSION}")
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(learner)
    _dcp(dcp.load, state, folder / DCP_DIR)
    set_state_dict(learner.model, learner.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    learner.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", map_location="cpu", weights_only=True))
    learner.step_count = int(trainer_state["step"])
    learner.policy_version = int(trainer_state["policy_version"])
    rng_path = folder / f"rng_rank{dist.rank()}.pt"
    # A run resumed on more ranks than it was saved with has no RNG state for the new ranks; they keep
    # their seeded streams (the run continues, just not bit for bit).
    if rng_path.is_file():
        _set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=True))
    return trainer_state


def _dcp_state(learner: Learner) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name (sharded DTensors under FSDP2, plain otherwise),
    the layout DCP saves and reshards on load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(learner.model, learner.optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _dcp(fn: Any, state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():  # one process without a process group is the intended world size 1
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        fn(state, checkpoint_id=path)


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copy the safetensors weights of a save_pretrained folder into model (dtype and device kept)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(folder / name, device="cpu"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # save_pretrained writes a tied parameter once; its other names are legitimately missing.
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    loaded = set(weights)
    by_name = {n: names for names in aliases.values() for n in names}
    really_missing = [n for n in missing if not loaded.intersection(by_name.get(n, []))]
    if unexpected or really_missing:
        raise ValueError(f"checkpoint: weights do not match the model: missing {really_missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def _rng_state() -> dict[str, Any]:
    np_kind, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy_kind": np_kind,
        "numpy_key": torch.from_numpy(np.asarray(np_key, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "python_version": py_version,
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "python_gauss": py_gauss,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state((state["numpy_kind"], state["numpy_key"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    random.setstate((state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
