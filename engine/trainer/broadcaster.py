"""The trainer's side of weights by broadcast (engine/core/broadcast.py; protocol/SPEC.md, "Weights by broadcast").

    publish.py --offer(version, state)--> Broadcaster.run (a task on the event loop)
        picks the members: connected generators whose Hello offered our layout and backend, less the
        excluded; re-forms the group when they changed; sends each member a broadcast WeightsNotice;
        joins and broadcasts in a worker thread (asyncio.to_thread), so the event loop and the train loop
        never wait for it; a newer version offered meanwhile is the next one sent (older ones are skipped)
    generators --WeightsAck--> on_ack: not ok for a version whose broadcast failed for the whole group: nothing
        (the member is healthy); else that generator is excluded: served by chunks for 8, 16, .. (at most 64)
        versions after each failure in a row, then a member again

One group for all members, re-formed when membership changes, rather than one small group per generator:
measured with gloo on 2 CPU cores over loopback (tools/bench.py weights, `per_generator_s_by_n`;
docs/weights-broadcast.md) the two are within noise of each other (N = 4, 64 MB: 0.47 s vs 0.46 s), and
only a group of N+1 lets gloo / NCCL fan the bytes out so the trainer's egress stays ~1x the model on a
real network. Its cost: a frozen member fails one version for all (they fetch it by chunks). A member that
never joins is named by the bounded rendezvous (Group.join) and excluded the same way; a failure mid-broadcast (a member
killed or frozen) costs one timeout: the group is dropped, each member falls back to chunks by itself after
its own bounded wait, and the next version re-forms the group. A member declared dead (or gone) mid-broadcast
costs less: the others are served by chunks at once, until the broadcast's timeout ends it (member_gone).
Test: pytest tests/engine/core/test_broadcast.py tests/engine/trainer/test_weights_broadcast.py
      tests/faults/test_broadcast_faults.py
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import msgspec

from tailrace.engine.core.broadcast import Group, JoinFailed, fingerprint, layout_of, master_store, plan
from tailrace.protocol import messages as m

log = logging.getLogger("tailrace.trainer")


def store_host(bind_address: str) -> str:
    """Where the TCPStore listens: the host the trainer's ROUTER is bound to (ipc/inproc: loopback)."""
    if not bind_address.startswith("tcp://"):
        return "127.0.0.1"
    host = bind_address[len("tcp://"):].rpartition(":")[0].strip("[]")
    return "0.0.0.0" if host in ("*", "") else host


def make_broadcaster(cfg: Any, server: Any, counters: collections.Counter) -> Broadcaster | None:
    """The run's broadcaster, or None where trainer.weights_transport says chunks or CURVE is on (the
    TCPStore is not authenticated)."""
    t = cfg.trainer
    if t.weights_transport != "auto" or t.curve_secret_key_file:
        return None
    return Broadcaster(server, counters, bucket_bytes=t.weights_bucket_bytes, timeout_s=t.weights_broadcast_timeout_s,
                       device=cfg.model.device)


def weights_summary(counters: collections.Counter, generator_stats: dict[str, m.Stats]) -> dict[str, dict]:
    """For summary.json: how each generator took its versions, and the trainer's broadcast counters."""
    return {"weights_by_generator": {name: {k: st.counters.get(f"generator/weights/{k}", 0.0)
                                            for k in ("by_broadcast", "by_chunks", "broadcast_failed")}
                                     for name, st in generator_stats.items()},
            "weights_broadcast": {k.removeprefix("trainer/weights/"): v for k, v in counters.items()
                                  if k.startswith("trainer/weights/")}}


EXCLUDE_VERSIONS = 8  # a member that failed on its own is served by chunks this many versions, then tried again
EXCLUDE_MAX_VERSIONS = 64  # ... twice as long after each further failure in a row, at most this


class Broadcaster:
    def __init__(self, server: Any, counters: collections.Counter, *, bucket_bytes: int, timeout_s: float,
                 device: Any = "cpu"):
        import torch

        self.server, self.counters = server, counters
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.store: Any = None  # the TCPStore server, made at the first broadcast
        self.group: Group | None = None
        self.members: tuple[bytes, ...] = ()
        self.num_groups = 0
        self.excluded: dict[bytes, int] = {}  # peer id -> the first version it may be a member of again
        self.strikes: collections.Counter[bytes] = collections.Counter()  # failures since its last success
        self.received: dict[bytes, int] = {}  # peer id -> newest version broadcast to it
        self.latest: tuple[int, dict, m.WeightsNotice] | None = None
        self.layout = ""  # fingerprint of the published state dicts
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.last_s_by_version: dict[int, float] = {}
        self.sending: int | None = None  # the version whose broadcast runs now
        self.failed: collections.deque[int] = collections.deque(maxlen=64)  # versions whose broadcast failed
        self.refusals: dict[int, dict[bytes, str]] = {}  # version being sent -> members that acknowledged not ok
        self.lost_member_of: int | None = None  # the version being sent when a member left or was declared dead

    # ------------------------------------------------------------------------------------ from the service

    def can_join(self, peer: Any) -> bool:
        if self.lost_member_of is not None:  # the group's broadcast in flight cannot finish: chunks meanwhile
            return False
        caps = peer.hello.capabilities
        version = self.latest[0] if self.latest is not None else 0
        return (peer.role == "generator" and version >= self.excluded.get(peer.id, 0) and bool(self.layout)
                and caps.get("weights_layout") == self.layout
                and self.backend in str(caps.get("weights_broadcast", "")).split(","))

    def offer(self, version: int, state: dict, notice: m.WeightsNotice) -> None:
        if not self.layout:
            self.layout = fingerprint(layout_of(state))
        self.latest = (version, state, notice)
        self.wake.set()

    def membership_changed(self, peer: Any) -> None:
        """A peer joined or left: the next pass re-forms the group (and serves a newcomer the latest)."""
        if peer.event != "joined":
            self.received.pop(peer.id, None)
            self.excluded.pop(peer.id, None)
            self.strikes.pop(peer.id, None)
        self.wake.set()

    async def member_gone(self, peer: Any) -> None:
        """A generator left or was declared dead. Mid-broadcast to a group it belongs to, that broadcast cannot
        finish before its timeout (gloo cannot abort an operation in flight, and the others wait on it): the
        other members are sent the latest version's chunk notice now, and every version published until that
        broadcast ends goes by chunks (can_join is False), so a frozen member costs the run its dead verdict,
        not trainer.weights_broadcast_timeout_s."""
        self.membership_changed(peer)
        if self.sending is None or peer.id not in self.members or self.latest is None:
            return
        self.lost_member_of = self.sending
        self.counters["trainer/weights/broadcast_member_lost"] += 1
        notice = self.latest[2]
        log.warning("generator %s %s during the broadcast of weights v%d: the other members fetch v%d by chunks, "
                    "and every version until that broadcast ends", peer.name, peer.event, self.sending, notice.version)
        for peer_id in self.members:
            if peer_id != peer.id and peer_id in self.server.peers:
                await self.server.send(peer_id, notice)

    def on_ack(self, peer: Any, msg: m.WeightsAck) -> None:
        if msg.ok:
            self.counters["trainer/weights/broadcast_acks"] += 1
            return
        self.counters["trainer/weights/broadcast_refused"] += 1
        if msg.version in self.failed:  # the whole group's failure (another member froze or died), not its own
            return
        if msg.version == self.sending:  # decided when the trainer's side of the broadcast ends
            self.refusals.setdefault(msg.version, {})[peer.id] = peer.name
            return
        self._refused(peer.id, peer.name, msg.version, msg.text)

    def _refused(self, peer_id: bytes, name: str, version: int, text: str) -> None:
        log.warning("generator %s could not take version %d by broadcast (%s): serving it by chunks for a while",
                    name, version, text)
        self.exclude(peer_id)

    def exclude(self, peer_id: bytes) -> None:
        """Serve the peer by chunks for a while: EXCLUDE_VERSIONS, twice that, ... up to EXCLUDE_MAX_VERSIONS
        versions after each failure in a row, then it is a member again (one too slow to join once under load
        comes back; one that can never join costs the group an aborted version ever more rarely)."""
        self.strikes[peer_id] += 1
        version = self.latest[0] if self.latest is not None else 0
        self.excluded[peer_id] = version + min(EXCLUDE_VERSIONS << (self.strikes[peer_id] - 1), EXCLUDE_MAX_VERSIONS)
        self.received.pop(peer_id, None)
        self.wake.set()

    # ------------------------------------------------------------------------------------ the task

    async def run(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                if self.latest is None:
                    continue
                version, state, notice = self.latest
                peers = [p for p in self.server.peers.values() if self.can_join(p)]
                if version > 0 and any(self.received.get(p.id, 0) < version for p in peers):
                    await self.send(version, state, notice, peers)
        finally:
            await asyncio.to_thread(self.close)

    async def send(self, version: int, state: dict, notice: m.WeightsNotice, peers: list) -> None:
        ids = tuple(p.id for p in peers)
        fresh = self.group is None or ids != self.members
        if fresh:
            await asyncio.to_thread(self.drop_group)
            if self.store is None:
                self.store = await asyncio.to_thread(master_store, store_host(self.server.address), self.timeout_s)
            self.num_groups += 1
            self.group = Group(self.store, f"w{self.num_groups}", 0, len(peers) + 1, backend=self.backend,
                               timeout_s=self.timeout_s, device=self.device)
            self.members = ids
        group = self.group
        address = f"{store_host(self.server.address)}:{self.store.port}"
        for rank, peer in enumerate(peers, start=1):
            await self.server.send(peer.id, msgspec.structs.replace(
                notice, transport="broadcast", broadcast_store=address, broadcast_group=group.name,
                broadcast_backend=self.backend, broadcast_rank=rank, broadcast_world_size=len(peers) + 1,
                broadcast_bucket_bytes=self.bucket_bytes, broadcast_layout=self.layout,
                broadcast_timeout_s=self.timeout_s))
        started = time.monotonic()
        self.sending = version
        try:
            await self._send_bytes(version, group, fresh, state, peers, ids, started)
        finally:
            self.sending = self.lost_member_of = None
            refusals = self.refusals.pop(version, {})
        if version not in self.failed:  # it reached the others: those that said not ok failed on their own
            for peer_id, name in refusals.items():
                self._refused(peer_id, name, version, "acknowledged not ok")

    async def _send_bytes(self, version: int, group: Group, fresh: bool, state: dict, peers: list,
                          ids: tuple[bytes, ...], started: float) -> None:
        try:
            await asyncio.to_thread(self._broadcast, group, fresh, state)
        except JoinFailed as exc:
            self.counters["trainer/weights/broadcast_failed"] += 1
            self.failed.append(version)
            log.warning("weights v%d by broadcast: %s; excluding them, the others fall back to chunks", version, exc)
            for rank in exc.missing:
                self.exclude(peers[rank - 1].id)
            await asyncio.to_thread(self.drop_group)
        except Exception as exc:  # a lost or frozen member (gloo / NCCL error or timeout): bounded, not fatal
            self.counters["trainer/weights/broadcast_failed"] += 1
            self.failed.append(version)
            log.warning("weights v%d by broadcast failed after %.1f s (%s: %s): group dropped, members fall back "
                        "to chunks, the next version re-forms it", version, time.monotonic() - started,
                        type(exc).__name__, exc)
            await asyncio.to_thread(self.drop_group)
        else:
            self.counters["trainer/weights/broadcasts"] += 1
            self.last_s_by_version[version] = time.monotonic() - started
            for peer_id in ids:
                self.received[peer_id] = version
                self.strikes.pop(peer_id, None)

    def _broadcast(self, group: Group, fresh: bool, state: dict) -> None:
        from tailrace.engine.core.broadcast import pack

        if fresh:
            group.join()
        for _ in group.broadcast(plan(layout_of(state), self.bucket_bytes), lambda b: pack(b, state, group.device)):
            pass

    def drop_group(self) -> None:
        group, self.group, self.members = self.group, None, ()
        if group is not None:
            group.close()

    def close(self) -> None:
        self.drop_group()
        self.store = None
