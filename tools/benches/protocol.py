"""Protocol benchmark: codec + transport throughput over tcp loopback, against plain ZeroMQ in the same run.

    python tools/bench.py protocol [--quick] [--json]

Two processes, a receiver (binds, like the trainer) and a sender (connects, like a generator), run these
phases, kept apart by a small control socket:

    raw_tensor      64 MB as one plain zmq frame, DEALER -> ROUTER                        (baseline)
    tensor          a 64 MB float32 tensor in a WeightsChunk: encode, Client.send, Server.recv, decode
    raw_rollouts    the frames of an encoded small Rollout, plain zmq, no codec           (reference)
    codec_rollouts  small Rollouts through the codec over plain sync zmq, no transport    (reference)
    rollouts        small Rollouts (4 small tensors, inline): encode, Client.send, Server.recv, decode

Each measurement alternates with its baseline over a few rounds so that both see the same machine state;
the receiver times each phase from its "go" to the last message received. Figures: rollout_msgs_per_s
(one direction), tensor_gb_per_s, raw_zmq_gb_per_s, ratio = tensor / raw (targets: 50000 msgs/s, 0.8),
plus the references and the codec's own encode/decode time of one small Rollout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

ROLLOUT_TARGET = 50_000
RATIO_TARGET = 0.8
TENSOR_BYTES = 64 << 20
PROMPT_TOKENS, COMPLETION_TOKENS = 64, 32
CREDITS = 1024  # messages the sender may have in flight (transport flow control): the application's bound
ROOT = Path(__file__).resolve().parents[2]


def small_rollout():
    import torch

    from tailrace.protocol.messages import Rollout

    return Rollout(group_id=12, sample_id=3, prompt_token_ids=torch.arange(PROMPT_TOKENS, dtype=torch.int32),
                   completion_token_ids=torch.arange(COMPLETION_TOKENS, dtype=torch.int32),
                   behaviour_logprobs=torch.full((COMPLETION_TOKENS,), -0.5),
                   policy_versions=torch.full((COMPLETION_TOKENS,), 4, dtype=torch.int32),
                   min_policy_version=4, max_policy_version=4, finish_reason="stop",
                   queue_s=0.01, decode_s=0.2, finished_wall_s=1795000000.0)


def weights_chunk():
    import torch

    from tailrace.protocol.messages import WeightsChunk

    tensor = torch.arange(TENSOR_BYTES // 4, dtype=torch.float32)
    return WeightsChunk(model="policy", version=1, chunk_index=0, num_chunks=1, tensors={"w": tensor})


def phases(quick: bool) -> list[tuple[str, int]]:
    """(phase, messages): a warm-up of each transport path, then alternating rounds."""
    rounds, num_tensors, num_rollouts = (2, 4, 25_000) if quick else (3, 10, 150_000)
    return [("warmup_tensor", 1), ("warmup_rollouts", 2_000),
            *[("raw_tensor", num_tensors), ("tensor", num_tensors)] * rounds,
            *[("raw_rollouts", num_rollouts), ("codec_rollouts", num_rollouts), ("rollouts", num_rollouts)] * rounds]


# ---------------------------------------------------------------------------------------- receiver


def receiver(quick: bool) -> None:
    """Binds a control ROUTER, a plain data ROUTER and a transport Server; for each phase answers the
    sender's announcement with "go", receives, and adds up the phase's time."""
    import torch  # noqa: F401  (a trainer has it loaded: keep the import out of the first decode's time)
    import zmq
    import zmq.asyncio

    from tailrace.protocol.codec import decode
    from tailrace.protocol.transport import Server, run

    ctx, actx = zmq.Context(), zmq.asyncio.Context()
    control, data = actx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for sock in (control, data):
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind("tcp://127.0.0.1:*")

    async def serve() -> dict:
        results: dict[str, dict] = {}
        async with Server("tcp://127.0.0.1:0", run_id="bench", credits=CREDITS) as server:
            print("ready", control.getsockopt_string(zmq.LAST_ENDPOINT),
                  data.getsockopt_string(zmq.LAST_ENDPOINT), server.address, flush=True)
            for name, count in phases(quick):
                peer, announced = await control.recv_multipart()
                assert announced.decode() == name, (announced, name)
                await control.send_multipart([peer, b"go"])
                start = time.perf_counter()
                if name.startswith("raw_"):  # blocking reads: the baseline gets the whole process
                    received_bytes = _receive_raw(data, count, copy=name != "raw_tensor")
                elif name == "codec_rollouts":
                    for _ in range(count):
                        msg = decode(data.recv_multipart()[1:])
                    received_bytes = 0
                else:
                    received_bytes = await _receive_messages(server, name, count)
                total = results.setdefault(name, {"count": 0, "seconds": 0.0, "bytes": 0})
                total["count"] += count
                total["seconds"] += time.perf_counter() - start
                total["bytes"] += received_bytes
                await control.send_multipart([peer, b"done"])
        assert msg.prompt_token_ids.tolist() == list(range(PROMPT_TOKENS))
        return results

    results = run(serve())
    print(json.dumps(results), flush=True)
    ctx.destroy(linger=0)
    actx.destroy(linger=0)


def _receive_raw(data, count: int, copy: bool) -> int:
    received = 0
    for _ in range(count):
        received += sum(len(f) for f in data.recv_multipart(copy=copy)[1:])
    return received


async def _receive_messages(server, name: str, count: int) -> int:
    received = 0
    while received < count:
        peer, msg = await server.recv()  # one await per message, as the trainer's net_loop consumes
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

    from tailrace.protocol.codec import encode
    from tailrace.protocol.transport import Client, run

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
                elif name == "codec_rollouts":
                    for _ in range(count):
                        data.send_multipart(encode(rollout))
                else:
                    msg = chunk if name.endswith("tensor") else rollout
                    for _ in range(count):
                        await client.send(msg)
                assert await control.recv() == b"done"

    run(send_all())
    ctx.destroy(linger=0)
    actx.destroy(linger=0)


# ---------------------------------------------------------------------------------------- driver


def codec_times_us() -> tuple[float, float]:
    """Best-of-repeats CPU time of encode and decode of one small Rollout, in microseconds."""
    from tailrace.protocol.codec import decode, encode

    msg = small_rollout()
    frames = [bytes(f) for f in encode(msg)]
    best = []
    for fn in (lambda: encode(msg), lambda: decode(frames)):
        best.append(min(timeit.repeat(fn, number=2000, repeat=7, timer=time.thread_time)) / 2000 * 1e6)
    return best[0], best[1]


def _spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "tools.benches.protocol", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)


def _exchange(quick: bool) -> dict:
    mode = "--quick" if quick else "--full"
    receiving, sending = _spawn("receive", mode), None
    try:
        ready = receiving.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError("the receiver did not start")
        sending = _spawn("send", mode, *ready[1:4])
        if sending.wait(timeout=120 if quick else 900) != 0:
            raise RuntimeError(f"the sender failed with exit code {sending.returncode}")
        results = json.loads(receiving.stdout.readline())
        receiving.wait(timeout=30)
        return results
    finally:
        for proc in (receiving, sending):
            if proc is not None and proc.poll() is None:
                proc.kill()


def run(quick: bool, log: Callable[[str], None]) -> dict:
    encode_us, decode_us = codec_times_us()
    log(f"codec, one small Rollout ({PROMPT_TOKENS}+{COMPLETION_TOKENS} tokens): encode {encode_us:.1f} us, "
        f"decode {decode_us:.1f} us")
    log(f"tcp loopback, sender and receiver in separate processes; transport credits {CREDITS}")
    log(f"phases: {', '.join(f'{n} x{c}' for n, c in phases(quick))}")
    results = _exchange(quick)
    rate = {name: r["count"] / r["seconds"] for name, r in results.items()}
    gbps = {name: r["bytes"] / r["seconds"] / 1e9 for name, r in results.items()}
    for name, r in results.items():
        if not name.startswith("warmup"):
            extra = f", {gbps[name]:.2f} GB/s" if r["bytes"] else ""
            log(f"{name:15s} {r['count']:7d} messages in {r['seconds']:.3f} s: {rate[name]:,.0f} msgs/s{extra}")
    ratio = gbps["tensor"] / gbps["raw_tensor"]
    return {
        "rollout_msgs_per_s": round(rate["rollouts"]),
        "tensor_gb_per_s": round(gbps["tensor"], 3),
        "raw_zmq_gb_per_s": round(gbps["raw_tensor"], 3),
        "ratio": round(ratio, 3),
        "rollout_target": ROLLOUT_TARGET,
        "ratio_target": RATIO_TARGET,
        "rollout_target_met": rate["rollouts"] >= ROLLOUT_TARGET,
        "ratio_target_met": ratio >= RATIO_TARGET,
        "raw_zmq_rollout_msgs_per_s": round(rate["raw_rollouts"]),
        "codec_zmq_rollout_msgs_per_s": round(rate["codec_rollouts"]),
        "rollout_encode_us": round(encode_us, 2),
        "rollout_decode_us": round(decode_us, 2),
        "credits": CREDITS,
    }


if __name__ == "__main__":
    role, mode, *addresses = sys.argv[1:]
    if role == "receive":
        receiver(mode == "--quick")
    else:
        sender(mode == "--quick", *addresses)
