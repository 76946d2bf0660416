"""Weights by broadcast: the layout both sides derive from the model, and the torch.distributed group that
carries it (trainer rank 0, generators ranks 1..N; gloo on CPU, NCCL on GPUs, the same code).

The protocol stays the control plane (protocol/SPEC.md, "Weights by broadcast"): a generator says in its
Hello that it can join (capabilities weights_broadcast, weights_layout); the trainer names a TCPStore and a
group in each WeightsNotice it sends; both join, then the trainer broadcasts the state dict as flat
dtype-grouped buckets in the order `plan` derives from the names, dtypes and shapes alone. Every wait is
bounded by the notice's timeout_s, so a peer that dies or freezes costs a timeout, never a hang.
The group is built from a TCPStore and ProcessGroupGloo / ProcessGroupNCCL directly: no default group is
created or touched (the trainer's own FSDP group is left alone).
Test: pytest tests/engine/core/test_broadcast.py
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

JOIN_POLL_S = 0.01  # how often the trainer looks for members' join keys
WINDOW = 2  # buckets in flight at once: the next one is packed while the last one travels


class JoinFailed(RuntimeError):
    """The group did not form: `missing` names the ranks that did not join in time (trainer side), or the
    trainer called the group off (generator side, missing empty)."""

    def __init__(self, text: str, missing: tuple[int, ...] = ()):
        super().__init__(text)
        self.missing = missing


# ---------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int  # elements into its bucket
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    slots: tuple[Slot, ...]


Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


def layout_of(state: Mapping[str, torch.Tensor]) -> Layout:
    """(name, shape, dtype) of each tensor, sorted by name: the order does not depend on dict order."""
    return sorted((name, tuple(t.shape), t.dtype) for name, t in state.items())


def fingerprint(layout: Layout) -> str:
    """A short digest of the layout: equal on two sides means the same names, shapes and dtypes."""
    text = "\n".join(f"{name}|{str(dtype).removeprefix('torch.')}|{','.join(map(str, shape))}"
                     for name, shape, dtype in sorted(layout))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def plan(layout: Layout, bucket_bytes: int) -> list[Bucket]:
    """Buckets of one dtype each, of at most `bucket_bytes` (a larger tensor gets a bucket of its own), in an
    order fixed by the layout alone: dtypes by name, then tensors by name."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    for dtype in sorted({d for _, _, d in layout}, key=str):
        item = torch.empty((), dtype=dtype).element_size()
        slots: list[Slot] = []
        numel = 0
        for name, shape, d in sorted(layout):
            if d != dtype:
                continue
            n = 1
            for size in shape:
                n *= size
            if slots and (numel + n) * item > bucket_bytes:
                buckets.append(Bucket(dtype, numel, tuple(slots)))
                slots, numel = [], 0
            slots.append(Slot(name, shape, numel, n))
            numel += n
        if slots:
            buckets.append(Bucket(dtype, numel, tuple(slots)))
    return buckets


def pack(bucket: Bucket, state: Mapping[str, torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """The bucket's tensors, flattened into one new tensor on `device`."""
    flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
    for slot in bucket.slots:
        flat[slot.offset:slot.offset + slot.numel].copy_(state[slot.name].reshape(-1))
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> a view of `flat` in the tensor's shape (no copy)."""
    return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in bucket.slots}


# ---------------------------------------------------------------------------------------- the group


def store_address(announced: str, connect_address: str) -> tuple[str, int]:
    """(host, port) of the trainer's TCPStore from a notice's `host:port`; a wildcard host (the trainer bound
    every interface) means the host this generator reached the trainer at."""
    host, sep, port = announced.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"WeightsNotice.broadcast_store: {announced!r} is not host:port")
    if host in ("0.0.0.0", "*", "[::]", "::"):
        rest = connect_address.split("://", 1)[-1]
        host = rest.rpartition(":")[0] or "127.0.0.1"
    return host.strip("[]"), int(port)


def master_store(host: str, timeout_s: float) -> torch.distributed.TCPStore:
    """The trainer's TCPStore server on a free port of `host` (its `.port`), one for the whole run."""
    return torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=timeout_s))


class Group:
    """One weight-transfer group: rank 0 the trainer, ranks 1..world_size-1 generators.

    join() is the rendezvous: each generator sets its join key and waits for the trainer's verdict, the
    trainer waits (bounded) for every join key and says "ok" or "abort"; only then is the process group
    built, so a member that never comes costs the others one timeout, not a hang in the group's own
    rendezvous. Each broadcast waits at most timeout_s."""

    def __init__(self, store: torch.distributed.Store, name: str, rank: int, world_size: int, *, backend: str,
                 timeout_s: float, device: torch.device | str = "cpu"):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weights broadcast backend must be gloo or nccl, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.store = torch.distributed.PrefixStore(f"tailrace/weights/{name}", store)
        self.name, self.rank, self.world_size = name, rank, world_size
        self.backend, self.timeout_s, self.device = backend, timeout_s, torch.device(device)
        self.pg = None

    def join(self) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.rank == 0:
            self._await_members()
        else:
            self.store.set(f"joined/{self.rank}", b"1")
            self.store.set_timeout(2 * timeout)  # the trainer says its verdict within timeout_s of its start
            self.store.wait(["verdict"])
            if self.store.get("verdict") != b"ok":
                raise JoinFailed(f"the trainer called weight group {self.name} off (a member did not join)")
        if self.backend == "gloo":
            self.pg = torch.distributed.ProcessGroupGloo(self.store, self.rank, self.world_size, timeout)
        else:
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = torch.distributed.ProcessGroupNCCL(self.store, self.rank, self.world_size, options)

    def _await_members(self) -> None:
        keys = [f"joined/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = tuple(r for r, key in zip(range(1, self.world_size), keys, strict=True) if not self.store.check([key]))
            if not missing:
                self.store.set("verdict", b"ok")
                return
            if time.monotonic() > deadline:
                self.store.set("verdict", b"abort")
                raise JoinFailed(f"weight group {self.name}: ranks {list(missing)} did not join within "
                                 f"{self.timeout_s} s", missing)
            time.sleep(JOIN_POLL_S)

    def broadcast(self, buckets: list[Bucket], source: Callable[[Bucket], torch.Tensor]) -> Iterator[
            tuple[Bucket, torch.Tensor]]:
        """Broadcast each bucket from rank 0, at most WINDOW in flight, each wait bounded by timeout_s.
        `source(bucket)` gives the tensor to send (rank 0) or to receive into (the others); yields each
        (bucket, tensor) once its broadcast completed here."""
        assert self.pg is not None, "join() first"
        timeout = datetime.timedelta(seconds=self.timeout_s)
        in_flight: list[tuple[Bucket, torch.Tensor, object]] = []
        for bucket in buckets:
            flat = source(bucket)
            in_flight.append((bucket, flat, self.pg.broadcast(flat, 0, timeout)))
            if len(in_flight) >= WINDOW:
                yield self._wait(*in_flight.pop(0))
        while in_flight:
            yield self._wait(*in_flight.pop(0))

    def _wait(self, bucket: Bucket, flat: torch.Tensor, work) -> tuple[Bucket, torch.Tensor]:
        work.wait(datetime.timedelta(seconds=self.timeout_s))  # raises on a timeout or a lost peer
        if flat.device.type == "cuda":
            torch.cuda.current_stream(flat.device).synchronize()
        return bucket, flat

    def close(self) -> None:
        """Drop the process group (aborting what is in flight); the store connection goes with the object."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except RuntimeError:  # some builds refuse abort on a group that failed; dropping it is enough
                pass


class Receiver:
    """A generator's side: joins the group a broadcast WeightsNotice names (re-joining when it names another)
    and receives a version into fresh buckets. receive() blocks: call it off the event loop."""

    def __init__(self, state: Mapping[str, torch.Tensor], connect_address: str, device: torch.device | str = "cpu"):
        self.layout = layout_of(state)
        self.fingerprint = fingerprint(self.layout)
        self.connect_address = connect_address
        self.device = torch.device(device)
        self.group: Group | None = None
        self._stores: dict[tuple[str, int], torch.distributed.TCPStore] = {}

    def backends(self) -> str:
        """What this side can join, for the Hello capability weights_broadcast."""
        return "nccl,gloo" if self.device.type == "cuda" else "gloo"

    def receive(self, notice) -> dict[str, torch.Tensor]:
        """name -> tensor of the version `notice` announces; raises (ValueError, JoinFailed, RuntimeError of
        torch.distributed) when it cannot, after at most a few timeouts."""
        if notice.broadcast_layout != self.fingerprint:
            raise ValueError(f"WeightsNotice.broadcast_layout {notice.broadcast_layout!r} is not this model's "
                             f"layout {self.fingerprint!r}")
        if notice.broadcast_backend not in self.backends().split(","):
            raise ValueError(f"WeightsNotice.broadcast_backend {notice.broadcast_backend!r}: this generator "
                             f"joins {self.backends()}")
        group = self.group
        if group is None or (group.name, group.rank, group.world_size) != (
                notice.broadcast_group, notice.broadcast_rank, notice.broadcast_world_size):
            self.close()
            address = store_address(notice.broadcast_store, self.connect_address)
            store = self._stores.get(address)
            if store is None:
                store = torch.distributed.TCPStore(*address, is_master=False, timeout=datetime.timedelta(
                    seconds=notice.broadcast_timeout_s))
                self._stores = {address: store}  # one trainer at a time
            device = self.device if notice.broadcast_backend == "nccl" else torch.device("cpu")
            group = Group(store, notice.broadcast_group, notice.broadcast_rank, notice.broadcast_world_size,
                          backend=notice.broadcast_backend, timeout_s=notice.broadcast_timeout_s, device=device)
            group.join()
            self.group = group
        out: dict[str, torch.Tensor] = {}
        empty = lambda b: torch.empty(b.numel, dtype=b.dtype, device=group.device)  # noqa: E731
        for bucket, flat in group.broadcast(plan(self.layout, notice.broadcast_bucket_bytes), empty):
            out.update(unpack(bucket, flat))
        return out

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
