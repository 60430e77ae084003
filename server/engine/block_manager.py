"""The KV pool's allocator: fixed-size blocks handed to sequences and taken back whole."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.missing(block_table, num_tokens) + reserve <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend ``block_table`` in place so it holds ``num_tokens`` tokens."""
        need = self.missing(block_table, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            block_table.append(self._free.pop())

    def release(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()
