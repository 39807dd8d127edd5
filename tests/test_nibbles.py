"""formats.nibbles: eight 4-bit codes per int32 word, code j in bits 4j .. 4j+3."""
import pytest
import torch

from sailfish.formats.nibbles import pack_nibbles, unpack_nibbles


def test_bit_positions():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [15, 0, 0, 0, 0, 0, 0, 15]])
    words = pack_nibbles(codes)
    assert words.dtype == torch.int32 and words.shape == (2,)
    assert words[0].item() == 0x87654321 - 2**32  # the top nibble 8 sets the sign bit
    assert words[1].item() == 0xF000000F - 2**32
    assert pack_nibbles(torch.tensor([3, 0, 0, 0, 0, 0, 0, 0])).item() == 3
    # independent reference: shift and mask in Python integers
    w = torch.randint(-2**31, 2**31, (5, 3), dtype=torch.int64).to(torch.int32)
    expect = [[[((int(v) & 0xFFFFFFFF) >> (4 * j)) & 0xF for j in range(8)] for v in row] for row in w]
    assert unpack_nibbles(w).tolist() == expect


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_roundtrip(dtype):
    codes = torch.randint(0, 16, (4, 6, 8)).to(dtype)
    back = unpack_nibbles(pack_nibbles(codes))
    assert back.dtype == torch.uint8 and torch.equal(back.to(dtype), codes)
    words = torch.randint(-2**31, 2**31, (7,), dtype=torch.int64).to(torch.int32)
    assert torch.equal(pack_nibbles(unpack_nibbles(words)), words)


def test_errors():
    with pytest.raises(ValueError, match=r"last dimension of 8, got shape \(3, 4\)"):
        pack_nibbles(torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="integer tensor, got torch.float32"):
        pack_nibbles(torch.zeros(8))
    with pytest.raises(TypeError, match="words must be int32, got torch.int64"):
        unpack_nibbles(torch.zeros(2, dtype=torch.int64))
