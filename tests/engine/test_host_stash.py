"""The host stash's chunks pinned ahead (`HostStash.reserve`): a later store pins nothing more,
and the limit holds. Pinning needs CUDA, so chunks here are plain memory standing in."""

from __future__ import annotations

import torch

from ember.engine.host_stash import HostStash

CHUNK = 1 << 10
GPU = torch.device("cuda")  # only named: no GPU is touched


def _stash(limit, monkeypatch) -> tuple[HostStash, list[bool]]:
    stash = HostStash(limit, chunk_bytes=CHUNK)
    pinned: list[bool] = []

    def new_chunk(pin: bool) -> torch.Tensor:
        pinned.append(pin)
        return torch.empty(CHUNK, dtype=torch.uint8)

    monkeypatch.setattr(stash, "_new_chunk", new_chunk)
    return stash, pinned


def test_a_store_after_reserve_pins_nothing(monkeypatch):
    stash, pinned = _stash(None, monkeypatch)
    assert stash.reserve(3 * CHUNK - 5, GPU) == 3 * CHUNK
    assert pinned == [True] * 3 and stash.allocated_bytes == 3 * CHUNK and stash.used_bytes == 0
    source = torch.arange(3 * CHUNK - 5, dtype=torch.int64).to(torch.uint8)
    stashed = stash.store(source)
    assert len(pinned) == 3  # every chunk came from the reserve
    target = torch.zeros_like(source)
    stash.load(stashed, target)
    assert torch.equal(target, source)
    assert stash.reserve(3 * CHUNK, GPU) == 0  # given back: already there


def test_reserve_stays_within_the_limit_and_off_a_gpu_does_nothing(monkeypatch):
    stash, pinned = _stash(2 * CHUNK, monkeypatch)
    assert not pinned
    assert stash.reserve(5 * CHUNK, GPU) == 2 * CHUNK
    assert len(pinned) == 2 and not stash.can_hold(3 * CHUNK)
    other, pinned_there = _stash(None, monkeypatch)
    assert other.reserve(5 * CHUNK, torch.device("cpu")) == 0 and not pinned_there
