"""Tile codecs against ttnn's own bytes, and their round trips."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.layouts.tt import bytes_to_tiles, page_bytes, tilize, untilize


def _golden(path):
    z = np.load(path)
    for i in range(int(z["n"])):
        x = torch.from_numpy(z[f"x{i}"].view(np.float32).copy())
        yield i, str(z[f"src{i}"]), x, torch.from_numpy(z[f"bf16_{i}"]), torch.from_numpy(z[f"bfp8_{i}"])


def test_golden_has_the_edge_cases(golden_path):
    """The golden set must exercise zeros, -0, denormals and fp32 inputs, or matching it proves less."""
    bits = np.concatenate([np.load(golden_path)[f"x{i}"].ravel() for i in range(10)])
    assert (bits == 0).any() and (bits == 0x80000000).any()
    assert (((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)).any()
    assert {str(np.load(golden_path)[f"src{i}"]) for i in range(10)} == {"bf16", "fp32"}


@pytest.mark.parametrize("case", range(10))
def test_tilize_matches_ttnn_bytes(golden_path, case):
    i, src, x, bf16, bfp8 = list(_golden(golden_path))[case]
    assert torch.equal(tilize(x, "bf16"), bf16)
    assert torch.equal(tilize(x, "bfp8_b"), bfp8)
    if src == "bf16":  # bf16 inputs give the same bytes as their fp32 widening
        assert torch.equal(tilize(x.to(torch.bfloat16), "bf16"), bf16)
        assert torch.equal(tilize(x.to(torch.bfloat16), "bfp8_b"), bfp8)


@pytest.mark.parametrize("case", range(10))
def test_untilize_inverts_golden(golden_path, case):
    _, _, x, bf16, bfp8 = list(_golden(golden_path))[case]
    assert torch.equal(untilize(bf16, x.shape, "bf16"), x.to(torch.bfloat16).float())
    y = untilize(bfp8, x.shape, "bfp8_b")
    assert torch.equal(tilize(y, "bfp8_b"), bfp8)  # decoding then re-encoding is a fixed point
    # bfloat8_b keeps 7 bits relative to each 16-value row's largest exponent
    rowmax = x.abs().reshape(*x.shape[:-1], -1, 16).amax(-1, keepdim=True).expand(*x.shape[:-1], -1, 16).reshape(x.shape)
    assert torch.all((y - x).abs() <= rowmax * 2.0**-6 + 1e-30)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    ht=st.integers(1, 3),
    wt=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_bf16_round_trip_is_exact(batch, ht, wt, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*batch, 32 * ht, 32 * wt, generator=g) * 10).to(torch.bfloat16)
    data = tilize(x, "bf16")
    assert data.numel() == x.numel() * 2
    assert torch.equal(untilize(data, x.shape, "bf16"), x.float())


def test_special_values_pack_as_ttnn_does():
    x = torch.zeros(32, 32)
    x[0, 0], x[0, 1], x[0, 2] = -0.0, 1e-40, -3.0  # -0 and a denormal share a row with a normal
    data = tilize(x, "bfp8_b")
    tiles = bytes_to_tiles(data.view(1, -1), "bfp8_b")
    assert tiles[0, 0, 0, 0].item() == 0 and tiles[0, 0, 0, 1].item() == 0 and tiles[0, 0, 0, 2].item() == -3.0
    assert data[64].item() == 0  # -0 loses its sign: a zero magnitude packs as +0


def test_padding_and_errors():
    x = torch.randn(2, 40, 20)
    data = tilize(x, "bf16")
    assert data.numel() == 2 * 2 * 1 * page_bytes("bf16")
    assert torch.equal(untilize(data, x.shape, "bf16"), x.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="bfp4"):
        tilize(x, "bfp4_b")
    with pytest.raises(ValueError, match="int32"):
        tilize(torch.zeros(32, 32, dtype=torch.int32), "bf16")
    with pytest.raises(ValueError, match="bytes"):
        untilize(data[:-1], x.shape, "bf16")
