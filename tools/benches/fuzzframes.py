"""Hostile frames for a live trainer endpoint: `burst(address, num_frames, seed)` sends them from plain
ZeroMQ DEALER sockets, some before any handshake and some from a session that said a valid Hello (role
"tool"), and returns how many messages it sent. Used by tools/benches/faultkit.py (the faults benchmark,
tests/faults/).

    random        random bytes in 1..4 frames
    truncated     a valid message cut short (header only, half a body, a tensor frame missing)
    oversized     a 200 KiB message before a handshake; a body over the 64 MiB body limit after one
    bombs         MessagePack that claims 2^32 elements, nests 60,000 arrays deep, or holds 11 million empty
                  arrays (the 11 MB body that froze the trainer for 17 s in issue 15)
    many tensors  a WeightsChunk of 65,536 small tensors: valid, seconds to decode in Python
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Iterator

import zmq

from tailrace.protocol import codec
from tailrace.protocol import messages as m

HEADER = codec.MAGIC + bytes((m.PROTOCOL_VERSION,))


def _header(kind_class: type) -> bytes:
    return HEADER + bytes((kind_class.KIND,))


def _bombs() -> Iterator[list[bytes]]:
    yield [_header(m.Stats), b"\xdd" + struct.pack(">I", 0xFFFFFFFF)]  # claims 2^32 - 1 elements
    yield [_header(m.Event), b"\x91" * 60_000 + b"\xc0"]  # 60,000 nested one-element arrays
    yield [_header(m.Stats), b"\xdd" + struct.pack(">I", 11_000_000) + b"\x90" * 11_000_000]


def _many_tensors() -> list:
    import numpy as np

    one = np.zeros(1, dtype=np.float32)  # each travels inline, in the body
    return codec.encode(m.WeightsChunk(model="drafter", version=1, chunk_index=0, num_chunks=1,
                                       tensors={f"t{i:05d}": one for i in range(1 << 16)}))


def _valid_hello(name: str) -> list:
    return codec.encode(m.Hello(role="tool", name=name, protocol_version=m.PROTOCOL_VERSION,
                                package_version="fuzz", incarnation=time.time_ns() // 1000))


def _hostile(rng: random.Random, welcomed: bool) -> Iterator[list]:
    """One round of hostile messages (frame lists) for a socket that did (or did not) get a Welcome."""
    hello = _valid_hello("fuzz-probe")
    for _ in range(8):
        yield [rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 4))]
    yield hello[:1]  # header only
    yield [hello[0], bytes(hello[1])[: len(hello[1]) // 2]]  # half a body
    yield [_header(m.Rollout), rng.randbytes(64)]
    yield [HEADER + bytes((255,)), b"\x90"]  # unknown kind
    yield from _bombs()
    if welcomed:
        yield [_header(m.WeightsChunk), b"\x95\xa7drafter\x01\x00\x01\x81\xa1w\x93\xa7float32\x91\x10\x07"]  # frame 7 absent
        yield [_header(m.Stats), b"\xc4\x00" + b"\0" * (65 << 20)]  # body over the 64 MiB limit
        yield _many_tensors()
    else:
        yield [_header(m.Hello), b"\0" * (200 << 10)]  # over the 64 KiB limit before a handshake


def _welcomed(ctx: zmq.Context, address: str, name: str, timeout_s: float = 10.0) -> zmq.Socket | None:
    """A DEALER that said a valid Hello and got a Welcome within timeout_s, else None."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart(_valid_hello(name))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(200):
            frames = sock.recv_multipart()
            if codec.peek_header(frames[0])[1] == m.Welcome.KIND:
                return sock
    sock.close()
    return None


def burst(address: str, num_frames: int, seed: int) -> int:
    """Send hostile messages to `address` until num_frames were sent; returns the count."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    sent = 0
    try:
        round_no = 0
        while sent < num_frames:
            welcomed = round_no % 2 == 1
            sock = _welcomed(ctx, address, f"fuzz-{seed}-{round_no}") if welcomed else ctx.socket(zmq.DEALER)
            round_no += 1
            if sock is None:
                continue
            if not welcomed:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
            for frames in _hostile(rng, welcomed):
                sock.send_multipart(frames, copy=False)
                sent += 1
                if sent >= num_frames:
                    break
            time.sleep(0.05)  # let the last ones leave before the socket closes
            sock.close()
    finally:
        ctx.term()
    return sent


# ---------------------------------------------------------------------------------------- the largest messages

def _largest(sock: zmq.Socket, name: str, max_body_bytes: int) -> list:
    """Frames of the largest message of its kind that a trainer with this body limit accepts (or, for
    names ending in "_refused", just over it). `sock` is a welcomed generator session."""
    import numpy as np

    one = np.zeros(1, dtype=np.float32)
    per_tensor = len(codec.encode(m.WeightsChunk(model="drafter", version=1, chunk_index=0, num_chunks=1,
                                                 tensors={"t00000": one}))[1]) - 5
    if name in ("chunk_max_body", "chunk_refused"):
        n = max_body_bytes // per_tensor - 2 if name == "chunk_max_body" else 1 << 16
        return codec.encode(m.WeightsChunk(model="drafter", version=1, chunk_index=0, num_chunks=1,
                                           tensors={f"t{i:05d}": one for i in range(n)}))
    if name == "chunk_64mb_frame":
        return codec.encode(m.WeightsChunk(model="drafter", version=1, chunk_index=0, num_chunks=1,
                                           tensors={"w": np.zeros(16 << 20, dtype=np.float32)}))
    if name == "stats_1024":
        return codec.encode(m.Stats(role="generator", name="largest", state="generating", policy_version=0,
                                    counters={f"generator/x/{i:0200d}": 1.0 for i in range(1024)}, wall_s=0.0))
    if name == "rollout_2m_tokens":
        sock.send_multipart(codec.encode(m.WorkRequest(capacity=1, policy_version=0)))
        work = _recv_kind(sock, m.Work)
        item, n = work.items[0], m.MAX_TOKENS
        return codec.encode(m.Rollout(
            group_id=item.group_id, sample_id=item.first_sample_id,
            prompt_token_ids=np.array(item.prompt_token_ids, dtype=np.int32),
            completion_token_ids=np.zeros(n, dtype=np.int32), behaviour_logprobs=np.full(n, -0.5, np.float32),
            policy_versions=np.zeros(n, dtype=np.int32), min_policy_version=0, max_policy_version=0,
            finish_reason="stop"))
    return list(_bombs())[int(name.removeprefix("bomb_"))]


LARGEST = ("chunk_max_body", "chunk_refused", "chunk_64mb_frame", "stats_1024", "rollout_2m_tokens",
           "bomb_0", "bomb_1", "bomb_2")


def _recv_kind(sock: zmq.Socket, kind: type, timeout_s: float = 10.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(200):
            frames = sock.recv_multipart()
            if codec.peek_header(frames[0])[1] == kind.KIND:
                return codec.decode(frames)
    raise TimeoutError(f"no {kind.__name__} within {timeout_s} s")


def send_largest_on_cue(address: str, max_body_bytes: int, repeats: int) -> None:
    """`repeats` times for each case in LARGEST: build it on a fresh generator session, print "ready NAME",
    wait for a line on stdin, send it, print "sent NAME". The caller measures the trainer's loop lag
    around each send."""
    import sys

    ctx = zmq.Context()
    try:
        for i, name in enumerate(LARGEST * repeats):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            sock.send_multipart(codec.encode(m.Hello(role="generator", name=f"largest-{i}",
                                                     protocol_version=m.PROTOCOL_VERSION, package_version="test",
                                                     max_inflight=1)))
            _recv_kind(sock, m.Welcome)
            frames = _largest(sock, name, max_body_bytes)
            print(f"ready {name}", flush=True)
            sys.stdin.readline()
            sock.send_multipart(frames, copy=False)
            time.sleep(0.2)
            print(f"sent {name}", flush=True)
            sock.close()
    finally:
        ctx.term()
