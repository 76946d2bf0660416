"""Protocol benchmark: codec + transport throughput over tcp loopback, against plain ZeroMQ in the same run.

    python tools/bench.py protocol [--quick] [--json]

Two processes, a receiver (binds, like the trainer) and a sender (connects), run these phases in order,
kept apart by a small control socket:

    raw_tensor      a 64 MB buffer as one plain zmq frame, DEALER -> ROUTER          (baseline)
    raw_rollouts    the bytes of an encoded small Rollout as plain frames             (reference)
    tensor          a 64 MB float32 tensor in a WeightsChunk: encode, send, receive, decode
    rollouts        small Rollouts (4 small tensors, inline): encode, send, receive, decode

The receiver times each phase from its "go" to the last message received. Figures: rollout_msgs_per_s
(one direction), tensor_gb_per_s, raw_zmq_gb_per_s, ratio = tensor / raw; targets 50000 msgs/s and 0.8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROLLOUT_TARGET = 50_000
RATIO_TARGET = 0.8
TENSOR_BYTES = 64 << 20
PROMPT_TOKENS, COMPLETION_TOKENS = 64, 32
CREDITS = 1024
"""Messages the sender may have in flight (transport flow control): the application's bound."""
ROOT = Path(__file__).resolve().parents[2]


def small_rollout():
    import torch

    from protocol.messages import Rollout

    return Rollout(group_id=12, sample_id=3, prompt_token_ids=torch.arange(PROMPT_TOKENS, dtype=torch.int32),
                   completion_token_ids=torch.arange(COMPLETION_TOKENS, dtype=torch.int32),
                   behaviour_logprobs=torch.full((COMPLETION_TOKENS,), -0.5),
                   policy_versions=torch.full((COMPLETION_TOKENS,), 4, dtype=torch.int32),
                   min_policy_version=4, max_policy_version=4, finish_reason="stop",
                   queue_s=0.01, decode_s=0.2, finished_wall_s=1795000000.0)


def weights_chunk():
    import torch

    from protocol.messages import WeightsChunk

    tensor = torch.arange(TENSOR_BYTES // 4, dtype=torch.float32)
    return WeightsChunk(model="policy", version=1, chunk_index=0, num_chunks=1, tensors={"w": tensor})


def phases(quick: bool) -> list[tuple[str, int]]:
    """(phase, messages): a warm-up of each transport path, then rounds that alternate each
    measurement with its baseline, so that both see the same machine state."""
    rounds, num_tensors, num_rollouts = (2, 4, 30_000) if quick else (3, 10, 150_000)
    return [("warmup_tensor", 1), ("warmup_rollouts", 2_000),
            *[("raw_tensor", num_tensors), ("tensor", num_tensors)] * rounds,
            *[("raw_rollouts", num_rollouts), ("rollouts", num_rollouts)] * rounds]


# ---------------------------------------------------------------------------------------- receiver


def receiver(quick: bool, credits: int) -> None:
    """Binds a control ROUTER, a plain data ROUTER and a transport Server; for each phase answers the
    sender's announcement with "go", receives, and reports its time."""
    import torch  # noqa: F401  (a trainer has it loaded; not part of the first decode's time)
    import zmq
    import zmq.asyncio

    from protocol.transport import Server, run

    ctx, actx = zmq.Context(), zmq.asyncio.Context()
    control, data = actx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for sock in (control, data):
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind("tcp://127.0.0.1:*")

    async def serve() -> dict:
        results = {}
        async with Server("tcp://127.0.0.1:0", run_id="bench", credits=credits) as server:
            print("ready", control.getsockopt_string(zmq.LAST_ENDPOINT),
                  data.getsockopt_string(zmq.LAST_ENDPOINT), server.address, flush=True)
            for name, count in phases(quick):
                peer = await _announced(control, name)
                start = time.perf_counter()
                if name.startswith("raw_"):
                    received_bytes = _receive_raw(data, count, copy=name != "raw_tensor")
                else:
                    received_bytes = await _receive_messages(server, name, count)
                seconds = time.perf_counter() - start
                total = results.setdefault(name, {"count": 0, "seconds": 0.0, "bytes": 0})
                total["count"] += count
                total["seconds"] += seconds
                total["bytes"] += received_bytes
                await control.send_multipart([peer, b"done"])
        return results

    results = run(serve())
    print(json.dumps(results), flush=True)
    ctx.destroy(linger=0)
    actx.destroy(linger=0)


async def _announced(control, name: str) -> bytes:
    """Wait for the sender to announce phase `name`, and tell it to go."""
    peer, announced = await control.recv_multipart()
    assert announced.decode() == name, (announced, name)
    await control.send_multipart([peer, b"go"])
    return peer


def _receive_raw(data, count: int, copy: bool) -> int:
    received = 0
    for _ in range(count):
        received += sum(len(f) for f in data.recv_multipart(copy=copy)[1:])
    return received


async def _receive_messages(server, name: str, count: int) -> int:
    received = 0
    while received < count:
        peer, msg = await server.recv()
        if msg is None:  # the sender's "joined" event
            continue
        received += 1
    if name.endswith("rollouts"):
        assert msg.prompt_token_ids.tolist() == list(range(PROMPT_TOKENS))
        return 0
    assert msg.tensors["w"].numel() * 4 == TENSOR_BYTES
    return count * TENSOR_BYTES


# ---------------------------------------------------------------------------------------- sender


def sender(quick: bool, control_address: str, data_address: str, server_address: str) -> None:
    import zmq
    import zmq.asyncio

    from protocol.codec import encode
    from protocol.transport import Client, run

    ctx, actx = zmq.Context(), zmq.asyncio.Context()
    control, data = actx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    control.connect(control_address)
    data.setsockopt(zmq.SNDHWM, 0)
    data.connect(data_address)
    rollout, chunk = small_rollout(), weights_chunk()
    raw_rollout = [bytes(f) for f in encode(rollout)]
    raw_tensor = chunk.tensors["w"].numpy()

    async def send_all() -> None:
        async with Client(server_address, role="generator", name="bench-sender") as client:
            await client.connect(timeout_s=30)
            for name, count in phases(quick):
                await control.send(name.encode())
                assert await control.recv() == b"go"
                if name == "raw_tensor":
                    for _ in range(count):
                        data.send(raw_tensor, copy=False)
                elif name == "raw_rollouts":
                    for _ in range(count):
                        data.send_multipart(raw_rollout)
                else:
                    msg = chunk if name.endswith("tensor") else rollout
                    for _ in range(count):
                        await client.send(msg)
                assert await control.recv() == b"done"

    run(send_all())
    ctx.destroy(linger=0)
    actx.destroy(linger=0)


# ---------------------------------------------------------------------------------------- driver


def _spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "tools.benches.protocol", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)


def run(quick: bool, log: Callable[[str], None]) -> dict:
    log(f"phases: {', '.join(f'{n} x{c}' for n, c in phases(quick))}")
    log("tcp loopback, sender and receiver in separate processes")
    log(f"transport: protocol.transport Client -> Server, {CREDITS} credits")
    receiving = _spawn("receive", "--quick" if quick else "--full")
    try:
        ready = receiving.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError("the receiver did not start")
        sending = _spawn("send", "--quick" if quick else "--full", *ready[1:4])
        timeout_s = 120 if quick else 900
        if sending.wait(timeout=timeout_s) != 0:
            raise RuntimeError(f"the sender failed with exit code {sending.returncode}")
        results = json.loads(receiving.stdout.readline())
        receiving.wait(timeout=30)
    finally:
        for proc in (receiving, locals().get("sending")):
            if proc is not None and proc.poll() is None:
                proc.kill()
    for name, r in results.items():
        if name.startswith("warmup"):
            continue
        per_s = r["count"] / r["seconds"]
        extra = f", {r['bytes'] / r['seconds'] / 1e9:.2f} GB/s" if r["bytes"] else ""
        log(f"{name:13s} {r['count']:7d} messages in {r['seconds']:.3f} s: {per_s:,.0f} msgs/s{extra}")
    rollout_rate = results["rollouts"]["count"] / results["rollouts"]["seconds"]
    tensor_gbps = results["tensor"]["bytes"] / results["tensor"]["seconds"] / 1e9
    raw_gbps = results["raw_tensor"]["bytes"] / results["raw_tensor"]["seconds"] / 1e9
    ratio = tensor_gbps / raw_gbps
    return {
        "rollout_msgs_per_s": round(rollout_rate),
        "tensor_gb_per_s": round(tensor_gbps, 3),
        "raw_zmq_gb_per_s": round(raw_gbps, 3),
        "ratio": round(ratio, 3),
        "raw_zmq_rollout_msgs_per_s": round(results["raw_rollouts"]["count"] / results["raw_rollouts"]["seconds"]),
        "rollout_target": ROLLOUT_TARGET,
        "ratio_target": RATIO_TARGET,
        "rollout_target_met": rollout_rate >= ROLLOUT_TARGET,
        "ratio_target_met": ratio >= RATIO_TARGET,
        "credits": CREDITS,
    }


if __name__ == "__main__":
    role, mode, *addresses = sys.argv[1:]
    if role == "receive":
        receiver(mode == "--quick", CREDITS)
    else:
        sender(mode == "--quick", *addresses)
