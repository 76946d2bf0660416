"""Weights benchmark: one published version of an S MB state dict to N generator processes, by chunks over
ZeroMQ (WeightsNotice -> WeightsFetch / WeightsChunk, today's path) and by the torch.distributed broadcast
(engine/core/broadcast.py: one group of N + 1, gloo here, NCCL on GPUs), against a memcpy of the state dict.

    python tools/bench.py weights [--quick] [--json]

The bench process plays the trainer: a real transport Server, a WeightsStore serving chunks from its event
loop, and a weights Group broadcasting from a worker thread. Each generator process (this module with
--worker) connects as a generator, takes each notice by the transport it names (chunks: WeightsAssembler;
broadcast: Receiver) and answers WeightsAck whose text is the SHA-256 of what it received, so
`weights_equal` says every generator got every version bit-equal. One version's time runs from the notices
to the last acknowledgement. The broadcast group is formed once per N before the timed rounds (as in a
run whose members do not change; `join_s_by_n`). Also one small group per generator
(`per_generator_s_by_n`, N groups of 2 fed by N threads), the alternative design. trainer_stall_ms: the
longest lag of the trainer's event loop (a 1 ms ticker) during each transport's rounds.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHUNK_BYTES = 16 << 20  # trainer.weights_chunk_bytes' default
BUCKET_BYTES = 32 << 20  # trainer.weights_bucket_bytes' default
TIMEOUT_S = 120.0
TARGET_RATIO = 1.5  # broadcast at N = 4 within 1.5x of N = 1


def make_state(total_bytes: int, seed: int = 0):
    """A state dict of about total_bytes: eight tensors, half float32, half bfloat16 (two dtype groups)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    state, each = {}, total_bytes // 8
    for i in range(8):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        numel = each // torch.empty((), dtype=dtype).element_size()
        state[f"layers.{i}.weight"] = torch.randn(numel, generator=g).to(dtype).view(-1, 256)
    return state


def digest(state) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- generator side


async def worker(address: str, name: str) -> None:
    from tailrace.engine.core.broadcast import Receiver
    from tailrace.engine.core.weights import WeightsAssembler
    from tailrace.protocol import messages as m
    from tailrace.protocol.transport import Client

    receivers: dict[str, Receiver] = {}
    async with Client(address, role="generator", name=name) as client:
        await client.connect(timeout_s=60)
        assembler = None
        while True:
            msg = await client.recv()
            if isinstance(msg, m.Shutdown):
                break
            if isinstance(msg, m.WeightsNotice) and msg.transport == "broadcast":
                receiver = receivers.get(msg.broadcast_group)  # one per group: the bench keeps several alive
                if receiver is None:
                    receiver = receivers.setdefault(msg.broadcast_group, Receiver(make_state(msg.total_bytes), address))
                got = await asyncio.to_thread(receiver.receive, msg)
                await client.send(m.WeightsAck(model="policy", version=msg.version, ok=True, text=digest(got)))
            elif isinstance(msg, m.WeightsNotice):
                assembler = WeightsAssembler(msg)
                await client.send(m.WeightsFetch(model="policy", version=msg.version, chunk_index=0))
            elif isinstance(msg, m.WeightsChunk):
                got = assembler.add(msg)
                if got is None:
                    await client.send(m.WeightsFetch(model="policy", version=msg.version,
                                                     chunk_index=assembler.next_index()))
                else:
                    await client.send(m.WeightsAck(model="policy", version=msg.version, ok=True, text=digest(got)))
        for receiver in receivers.values():
            receiver.close()


# ---------------------------------------------------------------------------------------- trainer side


class Trainer:
    """The trainer's part: serves chunks, broadcasts, collects acks, and ticks to measure its loop's lag."""

    def __init__(self, server):
        from tailrace.engine.core.broadcast import master_store
        from tailrace.engine.core.weights import WeightsStore

        self.server, self.store = server, WeightsStore(CHUNK_BYTES)
        self.tcp = master_store("127.0.0.1", TIMEOUT_S)
        self.acks: dict[bytes, str] = {}
        self.acked = asyncio.Event()
        self.max_lag_s = 0.0
        self.groups: dict[tuple, object] = {}
        self.version = 0

    async def tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            self.max_lag_s = max(self.max_lag_s, time.perf_counter() - start - 0.001)

    async def serve(self) -> None:
        from tailrace.protocol import messages as m

        while True:
            peer, msg = await self.server.recv()
            if isinstance(msg, m.WeightsFetch):
                await self.server.send(peer.id, self.store.chunk("policy", msg.version, msg.chunk_index))
            elif isinstance(msg, m.WeightsAck):
                self.acks[peer.id] = msg.text
                self.acked.set()

    async def wait_acks(self, peers) -> dict[bytes, str]:
        while not all(p.id in self.acks for p in peers):
            self.acked.clear()
            await asyncio.wait_for(self.acked.wait(), TIMEOUT_S)
        return {p.id: self.acks[p.id] for p in peers}

    async def by_chunks(self, state, peers) -> float:
        self.version += 1
        notice = self.store.publish("policy", self.version, state)
        self.acks = {}
        start = time.perf_counter()
        for peer in peers:
            await self.server.send(peer.id, notice)
        await self.wait_acks(peers)
        return time.perf_counter() - start

    async def by_broadcast(self, state, cohorts) -> float:
        """One version to each cohort (a list of peers sharing one group), the cohorts' groups fed from one
        thread each."""
        import msgspec

        from tailrace.engine.core.broadcast import Group, fingerprint, layout_of, pack, plan
        from tailrace.protocol import messages as m

        self.version += 1
        layout = fingerprint(layout_of(state))
        notice = m.WeightsNotice(model="policy", version=self.version, num_chunks=0, num_tensors=len(state),
                                 total_bytes=sum(t.numel() * t.element_size() for t in state.values()))
        self.acks = {}
        jobs = []
        start = time.perf_counter()
        for peers in cohorts:
            key = (notice.total_bytes, tuple(p.id for p in peers))
            group = self.groups.get(key)
            fresh = group is None
            if fresh:
                group = self.groups[key] = Group(self.tcp, f"g{len(self.groups)}", 0, len(peers) + 1,
                                                 backend="gloo", timeout_s=TIMEOUT_S)
            for rank, peer in enumerate(peers, start=1):
                await self.server.send(peer.id, msgspec.structs.replace(
                    notice, transport="broadcast", broadcast_store=f"127.0.0.1:{self.tcp.port}",
                    broadcast_group=group.name, broadcast_backend="gloo", broadcast_rank=rank,
                    broadcast_world_size=len(peers) + 1, broadcast_bucket_bytes=BUCKET_BYTES,
                    broadcast_layout=layout, broadcast_timeout_s=TIMEOUT_S))

            def send(group=group, fresh=fresh):
                if fresh:
                    group.join()
                for _ in group.broadcast(plan(layout_of(state), BUCKET_BYTES), lambda b: pack(b, state)):
                    pass
            jobs.append(asyncio.to_thread(send))
        await asyncio.gather(*jobs)
        await self.wait_acks([p for peers in cohorts for p in peers])
        return time.perf_counter() - start


def memcpy_s(state) -> float:
    import torch

    dst = {k: torch.empty_like(v) for k, v in state.items()}
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        best = min(best, time.perf_counter() - start)
    return best


async def measure(sizes_mb: list[int], ns: list[int], rounds: int, log: Callable[[str], None]) -> dict:
    from tailrace.protocol.transport import Server

    figures: dict = {"broadcast_s_by_n": {}, "chunks_s_by_n": {}, "per_generator_s_by_n": {}, "join_s_by_n": {},
                     "memcpy_s": {}}
    equal = True
    stall = {"chunks": 0.0, "broadcast": 0.0}
    async with Server("tcp://127.0.0.1:0", run_id="bench-weights", heartbeat_interval_s=1.0,
                      missed_heartbeats=120) as server:
        trainer = Trainer(server)
        tasks = [asyncio.create_task(trainer.serve()), asyncio.create_task(trainer.tick())]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs = [subprocess.Popen([sys.executable, "-m", "tools.benches.weights", "--worker", server.address,
                                   f"gen-{i}"], cwd=ROOT, env=env) for i in range(max(ns))]
        try:
            while sum(p.role == "generator" for p in server.peers.values()) < max(ns):
                await asyncio.sleep(0.1)
            peers = sorted((p for p in server.peers.values() if p.role == "generator"), key=lambda p: p.name)
            for size_mb in sizes_mb:
                state = make_state(size_mb << 20)
                expected = digest(state)
                figures["memcpy_s"][size_mb] = memcpy_s(state)
                for key in ("broadcast_s_by_n", "chunks_s_by_n", "per_generator_s_by_n", "join_s_by_n"):
                    figures[key][size_mb] = {}
                for n in ns:
                    members = peers[:n]
                    figures["join_s_by_n"][size_mb][n] = await trainer.by_broadcast(state, [members])  # forms it
                    await trainer.by_broadcast(state, [[p] for p in members])  # forms the per-generator groups
                    times = {"broadcast": [], "chunks": [], "per_generator": []}
                    for _ in range(rounds):
                        for mode in times:
                            trainer.max_lag_s = 0.0
                            if mode == "chunks":
                                times[mode].append(await trainer.by_chunks(state, members))
                            else:
                                cohorts = [members] if mode == "broadcast" else [[p] for p in members]
                                times[mode].append(await trainer.by_broadcast(state, cohorts))
                            equal &= set(trainer.acks.values()) == {expected}
                            if mode in stall:
                                stall[mode] = max(stall[mode], trainer.max_lag_s * 1e3)
                    for mode, values in times.items():
                        figures[f"{mode}_s_by_n"][size_mb][n] = statistics.median(values)
                    log(f"{size_mb} MB to {n}: broadcast {figures['broadcast_s_by_n'][size_mb][n]:.3f} s, chunks "
                        f"{figures['chunks_s_by_n'][size_mb][n]:.3f} s, per-generator groups "
                        f"{figures['per_generator_s_by_n'][size_mb][n]:.3f} s (memcpy {figures['memcpy_s'][size_mb]:.3f} s)")
        finally:
            from tailrace.protocol import messages as m

            for peer in list(server.peers.values()):
                await server.send(peer.id, m.Shutdown(reason="bench done"))
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for task in tasks:
                task.cancel()
    figures["weights_equal"] = equal
    figures["trainer_stall_ms"] = stall
    return figures


def run(quick: bool, log: Callable[[str], None]) -> dict:
    from tailrace.protocol.transport import run as run_loop

    sizes, ns, rounds = ([16], [1, 2, 4], 2) if quick else ([64, 512], [1, 2, 4], 3)
    figures = run_loop(measure(sizes, ns, rounds, log))
    big = max(sizes)
    by_n = figures["broadcast_s_by_n"][big]
    figures["broadcast_n4_over_n1"] = by_n[4] / by_n[1]
    figures["chunks_n4_over_n1"] = figures["chunks_s_by_n"][big][4] / figures["chunks_s_by_n"][big][1]
    figures["ratio"] = figures["chunks_s_by_n"][big][4] / by_n[4]  # chunks over broadcast at N = 4
    figures["broadcast_n4_target"] = TARGET_RATIO
    figures["broadcast_n4_within_target"] = figures["broadcast_n4_over_n1"] <= TARGET_RATIO
    figures["size_mb"], figures["rounds"], figures["cpus"] = sizes, rounds, os.cpu_count()
    log(f"{big} MB: broadcast N=4 / N=1 = {figures['broadcast_n4_over_n1']:.2f} (target <= {TARGET_RATIO}); "
        f"chunks N=4 / N=1 = {figures['chunks_n4_over_n1']:.2f}; chunks / broadcast at N=4 = {figures['ratio']:.2f}; "
        f"equal: {figures['weights_equal']}")
    return figures


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    from tailrace.protocol.transport import run as run_loop

    run_loop(worker(sys.argv[2], sys.argv[3]))
