"""What DiLoCo's outer exchange puts on the wire: fp32, bf16, or int8 with a scale per block.

The exchange moves rows of equal length L, one per instance (`[R, L]` fp32). A codec turns
them into `[R, P]` payload rows of one dtype and back:

- fp32: the rows themselves (exact);
- bf16: rounded to nearest even (2 bytes an element);
- int8: each row is cut into blocks of `INT8_BLOCK` elements (the last one shorter), each
  block scaled by its largest magnitude / 127 and rounded to nearest even; the row is its
  L int8 values followed by its fp32 scales, as bytes (`L + 4 ceil(L / 128)` bytes).

Blocks never straddle two rows, so each row (one rank's chunk) decodes alone, and a
single-process reference that cuts the same rows gets the same bits. One payload row is
one collective's chunk: the bytes counted are exactly what is sent.
"""

from __future__ import annotations

import torch

from hfsdp.core.outer.outer_config import INT8_BLOCK


class Codec:
    """Encode and decode `[R, length]` fp32 rows for one comm dtype."""

    def __init__(self, comm_dtype: str, length: int):
        self.comm_dtype, self.length = comm_dtype, length
        self.blocks = -(-length // INT8_BLOCK)
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[comm_dtype]
        self.row = length + 4 * self.blocks if comm_dtype == "int8" else length

    @property
    def exact(self) -> bool:
        return self.comm_dtype == "fp32"

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """`[R, length]` fp32 -> `[R, self.row]` payload (the fp32 rows themselves when exact)."""
        if self.comm_dtype == "fp32":
            return rows
        if self.comm_dtype == "bf16":
            return rows.to(torch.bfloat16)
        count = rows.shape[0]
        blocks = self._blocks(rows, count)
        amax = blocks.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(blocks / scale[..., None]).clamp_(-127, 127).to(torch.int8)
        values = q.reshape(count, -1)[:, : self.length].view(torch.uint8)
        return torch.cat([values, scale.contiguous().view(torch.uint8)], dim=1)

    def decode(self, payload: torch.Tensor) -> torch.Tensor:
        """`[R, self.row]` payload -> `[R, length]` fp32 (a view of the payload when exact)."""
        if self.comm_dtype == "fp32":
            return payload
        if self.comm_dtype == "bf16":
            return payload.float()
        count = payload.shape[0]
        q = payload[:, : self.length].contiguous().view(torch.int8).float()
        scale = payload[:, self.length :].contiguous().view(torch.float32)
        blocks = self._blocks(q, count)
        return (blocks * scale[..., None]).reshape(count, -1)[:, : self.length]

    def _blocks(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """`rows` zero-padded to whole blocks, as `[R, blocks, INT8_BLOCK]`."""
        padded = rows.new_zeros(count, self.blocks * INT8_BLOCK)
        padded[:, : self.length] = rows
        return padded.view(count, self.blocks, INT8_BLOCK)
