"""The KV pool's allocator, with automatic prefix caching.

Blocks are handed to sequences and shared by reference count. With caching on, every full block
whose keys and values are in the cache gets a key: SHA-256 of the parent block's key and the
block's token ids, the chain starting from a salt naming the model, its dtype and the block size
(a predictable hash would let one request read another's cache), and from the request's
``cache_salt`` where it has one, so that only requests with the same salt share blocks (vLLM's
multi-tenant isolation: nobody can time another client's prompt). A dict maps keys to blocks. A
block nobody references keeps its key and its contents, in an LRU queue of evictable blocks; it
is only reused, and its key dropped, when no block without contents is left. A released
sequence's blocks join that queue deepest first, so a chain is evicted from its end and its
shared beginning stays longest. Only full blocks get keys, and a full block is never written
again, so a block is never written while another sequence reads it.

A sequence's first ``num_cached`` tokens have their keys and values in its blocks. ``match``
gives a new (or resumed) sequence the longest chain of cached blocks matching its tokens, never
its last token (which must run through the model to give the next token's logits).
"""

import hashlib
import sys
from array import array
from collections import OrderedDict


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False, salt: str = ""):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._root = hashlib.sha256(f"{salt}|block_size={block_size}".encode()).digest()
        self._refs = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._empty = list(range(num_blocks - 1, -1, -1))      # no contents worth keeping; pop() takes
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.query_tokens = 0                                   # tokens looked up by match()
        self.hit_tokens = 0                                     # of those, found in the cache

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: empty ones and cached ones nobody holds."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - self.num_free

    @property
    def num_cached_idle(self) -> int:
        """Blocks that hold a cached prefix and no sequence holds (evicted first come first)."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.missing(block_table, num_tokens) + reserve <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend ``block_table`` in place so it holds ``num_tokens`` tokens."""
        need = self.missing(block_table, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        for _ in range(need):
            block_table.append(self._take())

    def _take(self) -> int:
        if self._empty:
            block = self._empty.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self._key_of[block]
            self._key_of[block] = None
            if self._by_key.get(key) == block:
                del self._by_key[key]
        self._refs[block] = 1
        return block

    def release(self, block_table: list[int]) -> None:
        """Drop one reference to each block of ``block_table`` and empty it."""
        for block in reversed(block_table):                     # the deepest block is evicted first
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._key_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._empty.append(block)
        block_table.clear()

    # ---- prefix caching ---------------------------------------------------------------------

    def _keys(self, seq, num_blocks: int) -> list[bytes]:
        """The keys of ``seq``'s first ``num_blocks`` full blocks (computed once, kept on ``seq``)."""
        keys, bs = seq.block_keys, self.block_size
        if len(keys) < num_blocks:
            start, end = len(keys) * bs, num_blocks * bs
            ids = array("q", seq.prompt_ids[start:end] if end <= len(seq.prompt_ids) else seq.token_ids[start:end])
            if sys.byteorder == "big":
                ids.byteswap()                       # the keys hash int64 little-endian tokens
            tokens, step = memoryview(ids.tobytes()), 8 * bs
            parent = keys[-1] if keys else self._chain_root(seq.params.cache_salt)
            for i in range(num_blocks - len(keys)):
                parent = hashlib.sha256(parent + tokens[i * step:(i + 1) * step]).digest()
                keys.append(parent)
        return keys[:num_blocks]

    def _chain_root(self, cache_salt: str | None) -> bytes:
        """The parent key of a sequence's first block: the pool's root, salted by the request's salt."""
        if cache_salt is None:
            return self._root
        return hashlib.sha256(self._root + b"cache_salt|" + cache_salt.encode()).digest()

    def match(self, seq) -> int:
        """Gives ``seq`` (holding no blocks) the longest chain of cached blocks that starts its
        tokens, its last token excluded; returns the number of tokens they hold."""
        if seq.block_table:
            raise ValueError(f"match() is for a sequence holding no blocks, not {len(seq.block_table)}")
        self.query_tokens += seq.length
        for block in self._cached_chain(seq):
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            seq.block_table.append(block)
        hit = len(seq.block_table) * self.block_size
        self.hit_tokens += hit
        return hit

    def cached_prefix(self, seq) -> int:
        """The tokens ``match`` would find cached for ``seq`` now (nothing taken)."""
        return len(self._cached_chain(seq)) * self.block_size

    def _cached_chain(self, seq) -> list[int]:
        """The cached blocks of the longest chain that starts ``seq``'s tokens, its last token excluded."""
        chain = []
        if self.prefix_caching:
            for key in self._keys(seq, (seq.length - 1) // self.block_size):
                block = self._by_key.get(key)
                if block is None:
                    break
                chain.append(block)
        return chain

    def unmatch(self, seq) -> None:
        """Undoes ``match`` for a sequence that could not be scheduled after all."""
        self.query_tokens -= seq.length
        self.hit_tokens -= len(seq.block_table) * self.block_size
        self.release(seq.block_table)
        seq.num_cached = 0

    def free(self, seq, keep_cache: bool = True) -> None:
        """Returns a sequence's blocks, keeping what it computed cached (unless its last step failed)."""
        if keep_cache:
            self.commit(seq)
        self.release(seq.block_table)

    def commit(self, seq) -> None:
        """Keys for ``seq``'s full blocks whose keys and values are in the cache and whose token ids
        are known on the host. A block whose key another block already has stays unkeyed."""
        if not self.prefix_caching:
            return
        full = min(seq.num_cached, seq.length) // self.block_size
        for block, key in zip(seq.block_table[:full], self._keys(seq, full)):
            if self._key_of[block] is None and key not in self._by_key:
                self._key_of[block] = key
                self._by_key[key] = block

    def check(self, held_tables, finished_tables=()) -> None:
        """Walks the pool and raises AssertionError where it is inconsistent: a block held by a
        finished sequence, a reference count that is not the number of block tables holding the
        block, a block both free and held, a block neither free, cached nor held, a key map that
        does not match the blocks' keys. ``held_tables``: the block tables of every sequence the
        engine holds (running or waiting); ``finished_tables``: those of finished sequences."""
        for table in finished_tables:
            assert not table, f"a finished sequence still holds blocks {table}"
        refs = [0] * self.num_blocks
        for table in held_tables:
            for block in table:
                refs[block] += 1
        free = set(self._empty)
        assert len(free) == len(self._empty), "a block is twice in the empty list"
        assert not free & set(self._evictable), "a block is both empty and evictable"
        for block in range(self.num_blocks):
            idle = block in free or block in self._evictable
            assert refs[block] == self._refs[block], \
                f"block {block}: {refs[block]} sequences hold it, its count says {self._refs[block]}"
            assert idle == (refs[block] == 0), f"block {block}: free {idle} with {refs[block]} holders"
            if block in self._evictable:
                assert self._key_of[block] is not None, f"block {block} is evictable without a key"
            if block in free:
                assert self._key_of[block] is None, f"block {block} is empty with a key"
        for key, block in self._by_key.items():
            assert self._key_of[block] == key, f"block {block} is in the key map under another key"
        assert sum(k is not None for k in self._key_of) == len(self._by_key), "keys without a map entry"
