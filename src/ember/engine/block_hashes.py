"""The keys of the prefix cache: a keyed hash chain over a sequence's full KV blocks.

Block i's key hashes block i-1's key with block i's token ids, so one key names the whole prefix
up to the end of its block. The hash is BLAKE2b keyed with a secret drawn when the cache is made:
a client cannot predict keys or craft two different prefixes with one key (vLLM's CVE-2025-25183
came from an unkeyed, predictable hash), and 128-bit digests make an accidental collision
negligible. Each model instance has its own cache, so keys never meet across models.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

DIGEST_BYTES = 16
SECRET_BYTES = 32


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


class BlockHasher:
    """Extends a sequence's chain of block keys as its tokens become known."""

    def __init__(self, block_size: int, secret: bytes) -> None:
        self.block_size = block_size
        self._secret = secret

    def extend(
        self, chain: list[bytes], prompt: list[int], outputs: list[int], num_full_blocks: int
    ) -> None:
        """Append to ``chain`` the keys of blocks ``len(chain) .. num_full_blocks - 1`` of the
        sequence ``prompt + outputs`` (which holds at least that many full blocks)."""
        first = len(chain)
        if num_full_blocks <= first:
            return
        bs = self.block_size
        start, end, num_prompt = first * bs, num_full_blocks * bs, len(prompt)
        if end <= num_prompt:
            tokens = prompt[start:end]
        else:
            tokens = prompt[start:] + outputs[max(0, start - num_prompt) : end - num_prompt]
        data = np.asarray(tokens, dtype=np.int64).tobytes()
        step = bs * 8
        parent = chain[-1] if chain else b""
        secret = self._secret
        for offset in range(0, len(data), step):
            parent = hashlib.blake2b(
                parent + data[offset : offset + step], digest_size=DIGEST_BYTES, key=secret
            ).digest()
            chain.append(parent)
