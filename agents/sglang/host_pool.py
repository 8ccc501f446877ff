"""A stand-in for SGLang's host KV pool in ``page_first`` layout, for tests and the replay.

SGLang's real host pool (``MHATokenToKVPoolHost``) cannot be built on a CPU-only machine
(its config package imports torchvision), so this double has the same methods the storage
backend calls and the same page geometry: ``kv_buffer[2, tokens, token_elems]`` (K, then V;
``token_elems`` stands for layers x heads x head_dim), a page is ``page_size`` consecutive
token slots, its K rows then its V rows are two contiguous regions, and its flat form is
those two regions one after the other.
"""

from __future__ import annotations

import torch


class PageFirstHostPool:
    """Host memory for ``pages`` pages of ``page_size`` tokens of ``token_elems`` elements."""

    layout = "page_first"

    def __init__(self, pages: int, page_size: int, token_elems: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size = page_size
        self.size = pages * page_size
        self.token_elems = token_elems
        self.kv_buffer = torch.zeros(2, self.size, token_elems, dtype=dtype)

    @property
    def page_bytes(self) -> int:
        return 2 * self.page_size * self.token_elems * self.kv_buffer.element_size()

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per page of ``indices`` (``page_size`` token slots each): its K region's address
        and size, then its V region's."""
        item = self.kv_buffer.element_size()
        token_bytes = self.token_elems * item
        v_offset = self.size * token_bytes
        region = self.page_size * token_bytes
        base = self.kv_buffer.data_ptr()
        ptrs: list[int] = []
        for index in indices.tolist()[:: self.page_size]:
            k = base + index * token_bytes
            ptrs += [k, k + v_offset]
        return ptrs, [region] * len(ptrs)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.page_size * self.token_elems, dtype=self.kv_buffer.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(
            2, self.page_size, self.token_elems)
