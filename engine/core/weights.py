"""Versioned weight broadcast: the trainer's store of published versions and the generator's assembler.

The trainer publishes a CPU snapshot per version (so later optimizer steps cannot change a published
version), split into chunks of about `chunk_bytes`; generators fetch chunk by chunk after a
WeightsNotice and swap the full set in between decode steps. The store keeps the last `keep` versions
of each model so a slow fetch can finish while the next version is published.
Test: pytest tests/engine/core/test_weights.py
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tailrace.protocol.messages import WeightsChunk, WeightsNotice


def check_same_layout(state: dict[str, Any], reference: dict[str, Any], what: str, *, dtypes: bool = False,
                      partial: bool = False) -> None:
    """ValueError unless `state` has exactly the names and shapes of `reference` (checked before any copy);
    with `dtypes`, their dtypes too; with `partial`, `state` may hold only some of the names (one chunk)."""
    missing, extra = sorted(set(reference) - set(state)), sorted(set(state) - set(reference))
    if extra or (missing and not partial):
        raise ValueError(f"{what}: missing {missing}, unexpected {extra}")
    for name, value in state.items():
        if tuple(value.shape) != tuple(reference[name].shape):
            raise ValueError(f"{what}: {name} has shape {tuple(value.shape)}, expected "
                             f"{tuple(reference[name].shape)}")
        if dtypes and value.dtype != reference[name].dtype:
            raise ValueError(f"{what}: {name} has dtype {value.dtype}, expected {reference[name].dtype}")


def num_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def chunk_state_dict(state: dict[str, Any], chunk_bytes: int) -> list[dict[str, Any]]:
    """Split name -> tensor into ordered chunks of at most ~chunk_bytes (one tensor may exceed it)."""
    chunks: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunks[-1] and size + nbytes > chunk_bytes:
            chunks.append({})
            size = 0
        chunks[-1][name] = tensor
        size += nbytes
    return chunks if chunks[0] else []


@dataclass
class _Published:
    notice: WeightsNotice
    chunks: list[dict[str, Any]]


class WeightsStore:
    def __init__(self, chunk_bytes: int = 16 << 20, keep: int = 2):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.chunk_bytes = chunk_bytes
        self.keep = keep
        self._versions: dict[str, OrderedDict[int, _Published]] = {"policy": OrderedDict(), "drafter": OrderedDict()}

    def publish(self, model: str, version: int, state: dict[str, Any]) -> WeightsNotice:
        chunks = chunk_state_dict(state, self.chunk_bytes)
        total = num_bytes(state)
        notice = WeightsNotice(model=model, version=version, num_chunks=len(chunks), num_tensors=len(state),
                               total_bytes=total)
        versions = self._versions[model]
        versions[version] = _Published(notice, chunks)
        while len(versions) > self.keep:
            versions.popitem(last=False)
        return notice

    def latest(self, model: str) -> WeightsNotice | None:
        versions = self._versions[model]
        return next(reversed(versions.values())).notice if versions else None

    def chunk(self, model: str, version: int, index: int) -> WeightsChunk | None:
        """The chunk, or None if that version is no longer (or was never) served, or index is out of range."""
        published = self._versions[model].get(version)
        if published is None or not 0 <= index < len(published.chunks):
            return None
        return WeightsChunk(model=model, version=version, chunk_index=index, num_chunks=len(published.chunks),
                            tensors=published.chunks[index])


class WeightsAssembler:
    """Collects the chunks of one announced version; `add` returns the full state dict when complete."""

    def __init__(self, notice: WeightsNotice):
        self.notice = notice
        self.tensors: dict[str, Any] = {}
        self.received: set[int] = set()

    def next_index(self) -> int | None:
        for i in range(self.notice.num_chunks):
            if i not in self.received:
                return i
        return None

    def add(self, chunk: WeightsChunk) -> dict[str, Any] | None:
        if (chunk.model, chunk.version) != (self.notice.model, self.notice.version):
            raise ValueError(f"chunk of {chunk.model} v{chunk.version} while assembling "
                             f"{self.notice.model} v{self.notice.version}")
        if chunk.num_chunks != self.notice.num_chunks or chunk.chunk_index >= self.notice.num_chunks:
            raise ValueError(f"chunk {chunk.chunk_index}/{chunk.num_chunks} does not match the notice's "
                             f"{self.notice.num_chunks} chunks")
        if chunk.chunk_index not in self.received:
            self.received.add(chunk.chunk_index)
            self.tensors.update(chunk.tensors)
        if len(self.received) < self.notice.num_chunks:
            return None
        if len(self.tensors) != self.notice.num_tensors:
            raise ValueError(f"assembled {len(self.tensors)} tensors, the notice announced {self.notice.num_tensors}")
        return self.tensors
