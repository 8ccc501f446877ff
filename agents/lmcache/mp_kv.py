"""KV for :class:`~kvprefetch.agents.lmcache.mp_client.LMCacheMPClient`: the layout one
worker declares (:class:`KVLayout`), the caller's KV (bytes, arrays, tensors or a per-chunk
callable) checked against the layout and cut into chunks, and the copies into and out of the
server's shared-memory slots. torch and numpy are imported on use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Byte width of the dtypes an emulated engine may declare.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "uint8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KVLayout:
    """The KV cache geometry one worker declares to the server.

    The defaults are small on purpose: 2 planes (K, V) x 4 layers x 2 kv heads x 64 x
    float16 = 2 KiB per token, 512 KiB per 256-token chunk.
    """

    model_name: str = "kvp-emulated"
    world_size: int = 1
    rank: int = 0
    num_layers: int = 4
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: str = "float16"
    #: Tokens per paged block of the (emulated) engine; must divide the chunk size.
    block_size: int = 16
    #: MLA (one latent plane instead of K and V).
    use_mla: bool = False

    def __post_init__(self) -> None:
        if "@" in self.model_name or not self.model_name:
            raise ValueError(f"model_name must be non-empty without '@', got {self.model_name!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in world_size {self.world_size}")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def planes(self) -> int:
        return 1 if self.use_mla else 2

    @property
    def hidden_size(self) -> int:
        """Elements per token and layer in one plane (kv heads x head size)."""
        return self.num_kv_heads * self.head_size

    @property
    def token_bytes(self) -> int:
        return self.planes * self.num_layers * self.hidden_size * DTYPE_BYTES[self.dtype]

    def chunk_bytes(self, chunk_size: int) -> int:
        """Bytes of one stored object (one chunk of this rank)."""
        return chunk_size * self.token_bytes

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of a contiguous KV tensor for ``num_tokens``: ``[2, L, T, H]`` (MLA:
        ``[L, T, H]``), the layout LMCache stores one chunk in."""
        if self.use_mla:
            return (self.num_layers, num_tokens, self.hidden_size)
        return (2, self.num_layers, num_tokens, self.hidden_size)


def random_kv(layout: KVLayout, num_tokens: int, *, seed: int = 0) -> torch.Tensor:
    """Random KV of ``layout`` for ``num_tokens`` (deterministic per ``seed``)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype)
    shape = layout.kv_shape(num_tokens)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(dtype)


def as_kv_tensor(layout: KVLayout, kv: Any, num_tokens: int, aligned: int) -> torch.Tensor:
    """``kv`` (bytes, a numpy array or a tensor) as a CPU tensor of ``layout`` covering
    ``num_tokens`` or ``aligned`` tokens; ``ValueError`` / ``TypeError`` otherwise."""
    import numpy as np
    import torch

    dtype = getattr(torch, layout.dtype)
    if isinstance(kv, bytes | bytearray | memoryview):
        raw = bytes(kv)
        for tokens in (num_tokens, aligned):
            if len(raw) == tokens * layout.token_bytes:
                flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                tensor = flat.view(dtype).view(layout.kv_shape(tokens))
                break
        else:
            raise ValueError(
                f"kv has {len(raw)} bytes; {num_tokens} tokens of this layout take "
                f"{num_tokens * layout.token_bytes}")
    elif isinstance(kv, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(kv))
    elif isinstance(kv, torch.Tensor):
        tensor = kv.detach().cpu()
    else:
        raise TypeError(f"kv must be a tensor, an array or bytes, got {type(kv).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"kv has dtype {tensor.dtype}, the layout declares {dtype}")
    tokens = tensor.shape[-2] if tensor.dim() >= 2 else -1
    if tokens not in (num_tokens, aligned) or tuple(tensor.shape) != layout.kv_shape(
            tokens):
        raise ValueError(f"kv has shape {tuple(tensor.shape)}; expected "
                         f"{layout.kv_shape(num_tokens)}")
    return tensor


def chunk_source(layout: KVLayout, size: int, kv: Any, num_tokens: int, aligned: int
                 ) -> Callable[[int], torch.Tensor]:
    """``kv`` as a function from chunk index to that chunk's KV of ``size`` tokens
    (validated)."""
    if callable(kv):
        def produced(index: int) -> torch.Tensor:
            return as_kv_tensor(layout, kv(index), size, size)

        return produced
    tensor = as_kv_tensor(layout, kv, num_tokens, aligned)

    def sliced(index: int) -> torch.Tensor:
        return tensor.narrow(tensor.dim() - 2, index * size, size)

    return sliced


# Bulk copies go through numpy: single-threaded memcpy of whole rows, where torch's intra-op
# thread pool competes with the server on a small CPU node (``kvprefetch bench lmcache``).


def _bytes_view(tensor: torch.Tensor) -> Any:
    import torch

    return tensor.view(torch.uint8).numpy()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    import numpy as np

    try:
        np.copyto(_bytes_view(dst), _bytes_view(src))
    except (RuntimeError, TypeError, ValueError):  # last dim not contiguous: let torch do it
        dst.copy_(src)


def concat_tokens(chunks: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate chunks along the token axis (dim -2) into a new tensor."""
    import numpy as np
    import torch

    joined = np.concatenate([_bytes_view(c) for c in chunks], axis=chunks[0].dim() - 2)
    return torch.from_numpy(joined).view(chunks[0].dtype)
