"""One forward of a ragged batch: token ids in, each sequence's next-token logits out."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hawk.engine.model import LlamaModel
from hawk.engine.attention import SeqSlice


class ModelRunner:
    def __init__(self, model: LlamaModel, attn):
        self.model, self.attn = model, attn

    @torch.inference_mode()
    def forward(self, tokens: Sequence[Sequence[int]], slices: Sequence[SeqSlice]) -> torch.Tensor:
        """``tokens[i]`` are sequence i's new tokens, at positions ``slices[i].start ...``; returns ``[n, vocab]`` fp32."""
        dev = self.model.device
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64, device=dev)
        pos = torch.cat([torch.arange(s.start, s.start + s.q_len) for s in slices]).to(dev)
        self.attn.begin(slices)
        hidden = self.model(ids, pos, self.attn)
        last = torch.cumsum(torch.tensor([s.q_len for s in slices], device=dev), 0) - 1
        return self.model.compute_logits(hidden[last])
