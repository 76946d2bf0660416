"""The trainer's drafter relay: generators upload speculative-decoding drafters they trained, the trainer
checks them and republishes the good ones to every generator (protocol/SPEC.md, "Drafter sharing").

    announce  WeightsNotice(model="drafter", v) from a generator: taken only when drafters are accepted
              (trainer.accept_drafters), v is the served version + 1, no other fetch is under way, and
              the announced tensor count and total bytes are a drafter's for this policy
    fetch     WeightsFetch -> WeightsChunk, one chunk at a time from that generator; each chunk's names,
              shapes and dtypes are checked before it is kept, the assembled state once more
    publish   the drafter is served as version v to every generator and on the notice socket, and saved
              with every checkpoint; a resumed trainer serves it again (after the same checks)

The layout a drafter must have is derived from the policy itself (engine/core/drafter.py
expected_state), never from what was uploaded before. A refused upload is logged and counted
(trainer/drafter/rejected and .../rejected/<reason>) and nothing of it is kept. Test:
pytest tests/engine/test_drafter_sharing.py
"""

from __future__ import annotations

import collections
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tailrace.engine.core.weights import WeightsAssembler, WeightsStore, check_same_layout, num_bytes
from tailrace.protocol import messages as m

log = logging.getLogger("tailrace.trainer")

DRAFTER_FILE = "drafter.safetensors"  # in a checkpoint folder: the last drafter the trainer served
DRAFTER_FETCH_TIMEOUT_S = 60.0  # a drafter fetch older than this gives way to the next announcement


class DrafterRelay:
    """`policy` None: drafters are not accepted (trainer.accept_drafters false). `server` is set by the
    trainer once its transport runs."""

    def __init__(self, store: WeightsStore, counters: collections.Counter, policy: torch.nn.Module | None):
        self.store = store
        self.counters = counters
        self.server: Any = None
        self.reference: dict[str, torch.Tensor] | None = None  # meta tensors: what an upload must be
        if policy is not None:
            from tailrace.engine.core.drafter import expected_state  # the layout only

            self.reference = expected_state(policy)
        self.fetch: tuple[bytes, WeightsAssembler] | None = None  # (source peer id, its chunks so far)
        self.fetch_started_s = 0.0  # time.monotonic()
        self.state: dict[str, torch.Tensor] | None = None  # the served drafter, for checkpoints

    def version(self) -> int:
        latest = self.store.latest("drafter")
        return latest.version if latest is not None else 0

    def forget_fetch_from(self, peer_id: bytes) -> None:
        """That generator left, or no longer serves the version being fetched: the next announcement starts over."""
        if self.fetch is not None and self.fetch[0] == peer_id:
            self.fetch = None

    async def on_notice(self, peer: Any, msg: m.WeightsNotice) -> None:
        """Fetch the announced drafter if it is the next version with a drafter's size and no other fetch is
        under way (announcements meanwhile are skipped: generators announce again after more training)."""
        if self.reference is None:
            return self.refuse(peer, msg.version, "off", "trainer.accept_drafters is false")
        busy = self.fetch is not None and time.monotonic() - self.fetch_started_s < DRAFTER_FETCH_TIMEOUT_S
        if msg.version != self.version() + 1 or busy:
            self.counters["trainer/drafter/announcements_skipped"] += 1
            return
        ref = self.reference
        if (msg.num_tensors, msg.total_bytes) != (len(ref), num_bytes(ref)) or msg.num_chunks == 0:
            return self.refuse(peer, msg.version, "layout", (
                f"announced {msg.num_tensors} tensors of {msg.total_bytes} bytes in {msg.num_chunks} chunks; "
                f"a drafter for this policy has {len(ref)} tensors of {num_bytes(ref)} bytes"))
        self.fetch = (peer.id, WeightsAssembler(msg))
        self.fetch_started_s = time.monotonic()
        await self.server.send(peer.id, m.WeightsFetch(model="drafter", version=msg.version, chunk_index=0))

    async def on_chunk(self, peer: Any, msg: m.WeightsChunk) -> None:
        fetch = self.fetch
        if fetch is None or fetch[0] != peer.id or msg.model != "drafter" or msg.version != fetch[1].notice.version:
            self.counters["trainer/drafter/chunks_unexpected"] += 1
            return
        assembler = fetch[1]
        problem = self.problem(msg.tensors, partial=True)  # before the chunk is kept
        tensors = None
        if problem is None:
            try:
                tensors = assembler.add(msg)
            except ValueError as exc:
                problem = str(exc)
        if problem is None and tensors is not None:
            problem = self.problem(tensors)
        if problem is not None:
            self.fetch = None
            return self.refuse(peer, msg.version, "layout", problem)
        if tensors is None:
            await self.server.send(peer.id, m.WeightsFetch(model="drafter", version=msg.version,
                                                           chunk_index=assembler.next_index()))
            return
        self.fetch = None
        await self.publish(msg.version, tensors, source=peer.name)

    def problem(self, tensors: dict[str, Any], partial: bool = False) -> str | None:
        """Why `tensors` is not (part of, with `partial`) a drafter for this policy, or None."""
        if self.reference is None:
            return "trainer.accept_drafters is false"
        try:
            check_same_layout(tensors, self.reference, "drafter", dtypes=True, partial=partial)
        except ValueError as exc:
            return str(exc)
        return None

    def refuse(self, peer: Any, version: int, reason: str, text: str) -> None:
        self.counters["trainer/drafter/rejected"] += 1
        self.counters[f"trainer/drafter/rejected/{reason}"] += 1
        log.warning("drafter v%d from %s refused: %s", version, peer.name, text)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor], *, source: str) -> None:
        notice = self.store.publish("drafter", version, tensors)
        self.state = tensors
        self.counters["trainer/drafter/published"] += 1
        log.info("drafter v%d from %s republished to the generators", version, source)
        for peer in list(self.server.peers.values()):
            if peer.role == "generator":
                await self.server.send(peer.id, notice)
        await self.server.publish(notice)

    # ------------------------------------------------------------------------------------ checkpoints

    def save(self, folder: Path) -> None:
        if self.state is None:
            return
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.state.items()}, str(folder / DRAFTER_FILE),
                  metadata={"version": str(self.version())})

    def restore(self, folder: Path) -> None:
        """Serve again the drafter saved with checkpoint `folder`, if any and if it still passes the checks,
        as its version: generators get it when they join, as they would have from the run before."""
        path = folder / DRAFTER_FILE
        if not path.is_file():
            return
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as saved:
                version = int((saved.metadata() or {}).get("version", "1"))
                tensors = {name: saved.get_tensor(name) for name in saved.keys()}  # noqa: SIM118 (not a dict)
            problem = self.problem(tensors)
        except (OSError, ValueError, SafetensorError) as exc:
            problem = str(exc)
        if problem is not None:
            # The drafter only speeds decoding up: the run resumes without it and generators train anew.
            log.warning("drafter in %s not restored (%s); generators start from their own", path, problem)
            return
        self.store.publish("drafter", max(version, 1), tensors)
        self.state = tensors
        log.info("drafter v%d restored from %s", max(version, 1), folder)
