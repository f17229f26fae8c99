"""Codecs, error feedback and the compressed path on one process (pure functions, one rank)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowcomm.comm import Communicator, FlatBuckets
from lowcomm.compress import (
    BF16,
    Compressor,
    LGreCo,
    PowerSGD,
    Quantize,
    Raw,
    Sign,
    TopK,
    parse_compression,
)
from lowcomm.compress.formats import ElementwiseCodec, pack_bits, unpack_bits
from lowcomm.outer import CO2, CoCoDC, DiLoCo, StreamingDiLoCo
from lowcomm.testing.reference import RefCompression

SHAPES = [(7,), (64,), (130,), (5, 77), (3, 4, 9)]


def _x(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-2, 1, math.prod(shape)).view(shape)


# -- wire bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 127, 128, 129, 1000])
@pytest.mark.parametrize("block", [1, 16, 128])
def test_quantize_bytes_are_the_documented_formula(n: int, block: int) -> None:
    x = _x((n,))
    for bits in (2, 4, 8):
        codec = Quantize(bits=bits, block=block)
        expected = math.ceil(n * bits / 8) + 4 * math.ceil(n / block)
        assert codec.encoded_nbytes((n,)) == expected
        assert codec.encode(x).numel() == expected
        assert codec.wire_nbytes((n,)) == (expected if expected < 4 * n else 4 * n)
    # int4: two values per byte, one fp32 scale per block
    assert Quantize(bits=4, block=block).encoded_nbytes((n,)) == (n + 1) // 2 + 4 * (
        (n + block - 1) // block
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_other_codecs_bytes_are_the_documented_formula(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    x = _x(shape)
    assert BF16().encode(x).numel() == BF16().wire_nbytes(shape) == 2 * n
    assert Raw().encode(x).numel() == Raw().wire_nbytes(shape) == 4 * n
    for density in (0.01, 0.1, 0.3):
        codec = TopK(density)
        k = max(1, math.ceil(density * n))
        assert codec.encode(x).numel() == codec.encoded_nbytes(shape) == 8 * k
        assert codec.wire_nbytes(shape) == (8 * k if 8 * k < 4 * n else 4 * n)
    for rank in (1, 2, 4):
        codec = PowerSGD(rank)
        if len(shape) < 2:
            assert not codec.compresses(shape) and codec.wire_nbytes(shape) == 4 * n
            continue
        rows, cols = shape[0], n // shape[0]
        r = min(rank, rows, cols)
        assert codec.encoded_nbytes(shape) == 4 * r * (rows + cols)
        assert codec.compresses(shape) == (r * (rows + cols) < rows * cols)


def test_tiny_tensors_are_sent_raw() -> None:
    assert not Quantize(bits=8).compresses((1,))  # 1 code + a 4-byte scale > 4 bytes
    assert not TopK(0.9).compresses((10,))  # 9 × 8 bytes > 40
    assert not PowerSGD(4).compresses((4, 4))  # factors as large as the matrix
    assert PowerSGD(4, only_if_smaller=False).compresses((4, 4))
    assert Raw().wire_nbytes((3, 3)) == 36


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_raw_and_bf16_round_trips(shape: tuple[int, ...]) -> None:
    x = _x(shape)
    assert torch.equal(Raw().roundtrip(x), x)
    y = BF16().roundtrip(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.all((x - y).abs() <= x.abs() * 2.0**-8)
    assert torch.equal(y, x.bfloat16().float())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("block", [4, 128])
def test_quantize_error_is_at_most_half_a_step(
    shape: tuple[int, ...], bits: int, block: int
) -> None:
    x = _x(shape, seed=bits)
    codec = Quantize(bits=bits, block=block)
    y = codec.roundtrip(x)
    flat, err = x.reshape(-1), (x - y).reshape(-1).abs()
    qmax = 2 ** (bits - 1) - 1
    for start in range(0, flat.numel(), block):
        step = flat[start : start + block].abs().max() / qmax
        assert err[start : start + block].max() <= step / 2 * (1 + 1e-5) + 1e-12
    # the largest magnitude of every block is exact (up to the scale's rounding)
    assert torch.allclose(y.reshape(-1).abs().max(), flat.abs().max(), rtol=1e-6)


def _documented_quantize_payload(
    x: torch.Tensor, bits: int, block: int, u: torch.Tensor | None
) -> bytes:
    """The module docstring's Quantize layout, element by element: fp32 scales, then the codes
    q + q_max packed 8/b to a byte (element i in bits b·(i mod 8/b) of byte i div (8/b)).
    ``u``: the U[0, 1) draw of each element of the padded blocks (stochastic rounding)."""
    flat = x.reshape(-1).tolist()
    n, qmax, per = len(flat), 2 ** (bits - 1) - 1, 8 // bits
    scales, codes = [], []
    for j in range(0, n, block):
        s = torch.tensor(max(abs(v) for v in flat[j : j + block])) / qmax  # fp32, as sent
        scales.append(float(s))
        for i in range(j, min(j + block, n)):
            y = torch.tensor(flat[i]) / (s if s > 0 else torch.tensor(1.0))
            q = torch.floor(y + u.reshape(-1)[i]) if u is not None else torch.round(y)
            codes.append(int(min(max(q, -qmax), qmax)) + qmax)
    packed = bytearray(-(-n * bits // 8))
    for i, c in enumerate(codes):
        packed[i // per] |= c << (bits * (i % per))
    return torch.tensor(scales, dtype=torch.float32).numpy().tobytes() + bytes(packed)


@pytest.mark.parametrize("n", [1, 3, 8, 13, 128, 200])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_payload_is_the_documented_layout_byte_for_byte(
    n: int, bits: int, stochastic: bool
) -> None:
    x = _x((n,), seed=n + bits)
    for block in (1, 5, 64):
        codec = Quantize(bits=bits, block=block, stochastic=stochastic)
        u = None
        if stochastic:  # the draws the codec takes: one per element of the padded blocks
            u = torch.rand((-(-n // block), block), generator=torch.Generator().manual_seed(3))
        g = torch.Generator().manual_seed(3) if stochastic else None
        payload = codec.encode(x, generator=g)
        assert bytes(payload.tolist()) == _documented_quantize_payload(x, bits, block, u)
        # decoding is q·s_j, element by element
        nbytes = 4 * -(-n // block)
        s = payload[:nbytes].clone().view(torch.float32)
        codes = unpack_bits(payload[nbytes:], bits, n).tolist()
        expected = [(c - (2 ** (bits - 1) - 1)) * s[i // block] for i, c in enumerate(codes)]
        assert torch.equal(codec.decode(payload, (n,)), torch.stack(expected))


def test_quantize_stochastic_rounding_is_unbiased_and_seeded() -> None:
    codec = Quantize(bits=4, block=8, stochastic=True)
    # one block: the max sets the step (1/7); the other values sit between codes
    x = torch.tensor([1.0, 0.03, -0.05, 0.5, 0.3, -0.77, 0.011, 0.9])
    step = 1.0 / 7
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([codec.roundtrip(x, generator=g) for _ in range(4000)])
    assert torch.all((draws - x).abs() < step * (1 + 1e-5))  # one step at most
    # unbiased: mean within ~6 standard errors (σ ≤ step/2 per draw), far from rounding bias
    assert torch.all((draws.mean(0) - x).abs() < 6 * (step / 2) / math.sqrt(4000))
    nearest = Quantize(bits=4, block=8).roundtrip(x)
    assert (nearest - x).abs().max() > 0.02  # so nearest rounding would fail the bound above
    a = codec.roundtrip(x, generator=torch.Generator().manual_seed(5))
    b = codec.roundtrip(x, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 127, 128, 129, 1000])
@pytest.mark.parametrize("block", [1, 16, 128])
def test_sign_sends_a_bit_an_element_scaled_by_its_blocks_mean_magnitude(
    n: int, block: int
) -> None:
    x = _x((n,), seed=n)
    codec = Sign(block=block)
    expected = math.ceil(n / 8) + 4 * math.ceil(n / block)
    assert codec.encoded_nbytes((n,)) == codec.encode(x).numel() == expected
    y = codec.roundtrip(x)
    for start in range(0, n, block):
        part, got = x[start : start + block], y[start : start + block]
        # every element ±(the block's mean |x|), with its own sign (0 counts as +)
        torch.testing.assert_close(got.abs(), part.abs().mean().expand_as(got))
        assert torch.equal(got >= 0, part >= 0)
    # one bit an element and a scale a block: 5/9 of int2's bytes at the default block
    if n == 1000 and block == 128:
        assert codec.wire_nbytes((n,)) == 157 and Quantize(bits=2).wire_nbytes((n,)) == 282


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", [0.01, 0.2, 1.0])
def test_topk_keeps_the_largest_exactly(shape: tuple[int, ...], density: float) -> None:
    x = _x(shape, seed=3)
    codec = TopK(density)
    y = codec.roundtrip(x)
    kept = y.reshape(-1) != 0
    assert int(kept.sum()) == codec.k(x.numel())
    assert torch.equal(y.reshape(-1)[kept], x.reshape(-1)[kept])
    if not kept.all():
        assert x.reshape(-1)[~kept].abs().max() <= x.reshape(-1)[kept].abs().min()


def _by_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k, dim=-1, sorted=False).indices.sort(dim=-1).values


@pytest.mark.parametrize(
    "kind", ["normal", "zeros", "rounded", "nan", "inf", "off_sample", "on_sample"]
)
@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 4),
    st.one_of(st.integers(1, 1100), st.integers(1100, 40_000)),
    st.floats(0.0005, 0.2),
    st.integers(0, 2**16),
)
def test_selecting_on_the_cpu_keeps_what_torch_topk_keeps(
    kind: str, rows: int, n: int, density: float, seed: int
) -> None:
    # lowcomm's NumPy selection on the CPU (a bound from every 16th element, the candidates
    # above it, their k largest; the whole row where the sample misled it) against torch.topk:
    # the same magnitudes kept (NaN the largest), k distinct indices a row, ascending, and the
    # same indices wherever the k-th magnitude is not repeated
    from lowcomm.compress.formats import largest

    g = torch.Generator().manual_seed(seed)
    k = max(1, min(n - 1, round(density * n))) if n > 1 else 1
    x = torch.randn(rows, n, generator=g)
    if kind == "zeros":  # most values 0: the k-th magnitude repeated
        x[:, torch.randperm(n, generator=g)[: n * 9 // 10]] = 0.0
    elif kind == "rounded":
        x = x.round()
    elif kind == "nan":
        x[0, torch.randint(0, n, (3,), generator=g)] = float("nan")
    elif kind == "inf":
        x[-1, torch.randint(0, n, (2,), generator=g)] = float("-inf")
    elif kind == "off_sample":  # the large values where the sample never looks
        x *= 1e-3
        x[:, 5::16] = torch.randn(rows, len(range(5, n, 16)), generator=g)
    elif kind == "on_sample":  # the large values only where it looks
        x[:, ::16] *= 100.0
    got, want = largest(x, k), _by_topk(x, k)
    assert got.shape == want.shape == (rows, k) and got.dtype == torch.int64
    assert torch.equal(got, got.sort(dim=1).values)
    assert all(len(set(r.tolist())) == k for r in got)
    mine = x.abs().gather(1, got).nan_to_num(nan=math.inf).sort(dim=1).values
    theirs = x.abs().gather(1, want).nan_to_num(nan=math.inf).sort(dim=1).values
    assert torch.equal(mine, theirs)
    if kind in ("normal", "off_sample", "on_sample"):  # (no magnitude repeated)
        assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_codes_pack_and_unpack_the_same_with_numpy_and_with_torch(
    bits: int, monkeypatch: Any
) -> None:
    # a bucket's codes packed 8/bits to a byte (NumPy on the CPU: one multiplication a word,
    # a table lookup a byte) as torch's shifts pack them, and as pack_bits lays them out;
    # unpacked from every rank's strided slice of the gathered bytes alike
    from lowcomm.compress import blocked, formats

    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3 * 4096,), generator=g).to(torch.uint8)
    gathered = torch.randint(0, 256, (3, 1000), generator=g).to(torch.uint8)
    ranks = gathered[:, 200:712]  # (3, 512), rows 1000 bytes apart
    with_numpy = blocked._pack(codes, bits), blocked._unpack(ranks, bits)
    monkeypatch.setattr(formats, "NUMPY_ON_CPU", False)
    with_torch = blocked._pack(codes, bits), blocked._unpack(ranks, bits)
    assert torch.equal(with_numpy[0], with_torch[0])
    assert torch.equal(with_numpy[0], pack_bits(codes, bits))
    assert torch.equal(with_numpy[1], with_torch[1])
    assert with_numpy[1].shape == (3, 512 * 8 // bits)
    assert torch.equal(with_numpy[1][1], unpack_bits(ranks[1].contiguous(), bits, 512 * 8 // bits))


def test_a_top_k_payload_is_the_same_whichever_way_the_cpu_selects(
    single_rank_group: None, monkeypatch: Any
) -> None:
    # the flat top-k section (tensors of one size as rows) and the per-tensor codec encode
    # the same bytes with NumPy's selection and with torch.topk's
    from lowcomm.compress import formats

    shapes = [(64, 512), (64, 512), (512,), (300, 7)]
    g = torch.Generator().manual_seed(5)
    buckets = FlatBuckets(shapes, bucket_cap_mb=25)
    values = [torch.randn(b.numel(), generator=g) for b in buckets.buffers]

    def encoded() -> list[torch.Tensor]:
        compressor = Compressor("topk:0.01", buckets.shapes, error_feedback=True)
        torch._foreach_copy_(buckets.buffers, values)
        Communicator().compressed_mean_async(buckets, compressor).wait()
        single = TopK(0.01).encode(values[0][:4000])
        return [b.clone() for b in buckets.buffers] + [single]

    with_numpy = encoded()
    monkeypatch.setattr(formats, "NUMPY_ON_CPU", False)
    with_torch = encoded()
    assert all(torch.equal(a, b) for a, b in zip(with_numpy, with_torch, strict=True))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=0, max_size=40), st.sampled_from([1, 2, 4, 8]))
def test_pack_unpack_round_trip(values: list[int], bits: int) -> None:
    codes = torch.tensor([v % (1 << bits) for v in values], dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == math.ceil(len(values) * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, len(values)), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_pack_bits_of_long_tensors_is_the_documented_layout(bits: int) -> None:
    # long enough for the field-by-field path of pack_bits; an odd tail pads with zeros
    n, per = 40_003, 8 // bits
    codes = torch.randint(0, 1 << bits, (n,), generator=torch.Generator().manual_seed(bits))
    codes = codes.to(torch.uint8)
    expected = bytearray(-(-n // per))
    for i, c in enumerate(codes.tolist()):
        expected[i // per] |= c << (bits * (i % per))
    packed = pack_bits(codes, bits)
    assert bytes(packed.tolist()) == bytes(expected)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_decode_accepts_payloads_at_any_offset() -> None:
    x = _x((5, 77))
    for codec in (BF16(), Quantize(bits=4, block=16), Sign(block=16), TopK(0.1), Raw()):
        payload = codec.encode(x)
        shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])[3:]
        assert torch.equal(codec.decode(shifted, x.shape), codec.roundtrip(x))


# -- a bucket encoded as a whole ----------------------------------------------------------------

_BUCKET_SPECS = [
    "int2",
    "int4",
    "int8",
    "int4:block=64",
    "int8:block=1",
    "int2:block=6",
    "int2:block=5",
    "int4:sr",
    "int4:block=7:sr",
    "sign",
    "sign:block=5",
    "topk:0.1",
    "topk:0.5",
    "bf16",
]


def _bucket_codecs(tensors: list[tuple[tuple[int, ...], str, str]]) -> list[ElementwiseCodec]:
    """The codec of each (shape, spec, kind): raw where the codec does not compress the shape,
    the first stochastic codec for every stochastic one (one generator per bucket)."""
    codecs: list[ElementwiseCodec] = []
    sr = None
    for shape, spec, _ in tensors:
        codec = parse_compression(spec)
        if codec.stochastic:
            sr = sr or codec
            codec = sr
        codecs.append(codec if codec.compresses(shape) else Raw())
    return codecs


def _bucket_input(shapes: list[tuple[int, ...]], kinds: list[str], seed: int) -> list[torch.Tensor]:
    out = []
    for i, (shape, kind) in enumerate(zip(shapes, kinds)):
        x = _x(shape, seed + i) * {"small": 1e-30, "large": 1e30}.get(kind, 1.0)
        if kind == "zero":
            x.zero_()
        elif kind == "negzero":
            x.zero_().neg_()  # every element −0.0
        out.append(x)
    return out


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([(1,), (3,), (4,), (128,), (129,), (300,), (5, 77), (2, 3, 4)]),
            st.sampled_from(_BUCKET_SPECS),
            st.sampled_from(["normal", "normal", "zero", "negzero", "small", "large"]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 4),
    st.integers(0, 1000),
)
def test_a_bucket_encodes_and_decodes_as_its_tensors_do_one_by_one(
    tensors: list[tuple[tuple[int, ...], str, str]], world: int, seed: int
) -> None:
    # the flat path sends each tensor's own bytes (a bucket's sections one after the other)
    # and decodes, sums in rank order and divides exactly as decoding tensor by tensor does:
    # bit for bit (stochastic rounding: one sr codec per bucket, its noise drawn over its
    # tensors in bucket order)
    from lowcomm.compress.flat import FlatLayout

    shapes = [t[0] for t in tensors]
    codecs = _bucket_codecs(tensors)
    xs = _bucket_input(shapes, [t[2] for t in tensors], seed)
    layout = FlatLayout(codecs, shapes, "cpu")
    g_flat, g_alone = (torch.Generator().manual_seed(seed) for _ in range(2))
    flat = torch.cat([x.reshape(-1) for x in xs])
    payload, mine = layout.encode(flat, generator=g_flat)
    alone = [c.encode(x, generator=g_alone if c.stochastic else None) for c, x in zip(codecs, xs)]
    assert payload.numel() == layout.size == sum(p.numel() for p in alone)
    assert torch.equal(payload.sort().values, torch.cat(alone).sort().values)  # the same bytes
    if len(xs) == 1:
        assert torch.equal(payload, alone[0])
    decoded = torch.cat([c.decode(p, x.shape).reshape(-1) for c, x, p in zip(codecs, xs, alone)])
    torch.testing.assert_close(mine, decoded, rtol=0, atol=0, equal_nan=True)
    # the other ranks' payloads: theirs for x·(r + 2), and their means decoded one by one
    others, rank_payloads = [], [payload]
    for r in range(world - 1):
        g_one, g_all = (torch.Generator().manual_seed(seed + 1 + r) for _ in range(2))
        scaled = [x * (r + 2) for x in xs]
        others.append(
            [c.encode(x, generator=g_one if c.stochastic else None) for c, x in zip(codecs, scaled)]
        )
        theirs, _ = layout.encode(torch.cat([x.reshape(-1) for x in scaled]), generator=g_all)
        rank_payloads.append(theirs)
    means = torch.empty_like(flat)
    layout.decode_mean(torch.cat(rank_payloads), world, out=means)
    off = 0
    for j, (codec, x) in enumerate(zip(codecs, xs)):
        total = codec.decode(alone[j], x.shape)
        for r in range(1, world):
            total.add_(codec.decode(others[r - 1][j], x.shape))
        if world > 1:
            total.div_(float(world))
        n = total.numel()
        torch.testing.assert_close(
            means[off : off + n], total.reshape(-1), rtol=0, atol=0, equal_nan=True
        )
        off += n


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([(128,), (256,), (640,), (8, 128), (129,), (40, 5)]),
            st.sampled_from(
                ["int8", "int4", "int2", "int4:sr", "int2:block=8", "sign", "topk:0.1"]
            ),
            st.sampled_from(["normal", "normal", "zero", "large", "nan"]),
        ),
        min_size=1,
        max_size=5,
    ),
    st.sampled_from([128, 256, 1 << 18]),
    st.booleans(),
    st.integers(0, 1000),
)
def test_encoding_with_feedback_in_chunks_is_encoding_then_subtracting(
    tensors: list[tuple[tuple[int, ...], str, str]], chunk: int, feedback: bool, seed: int
) -> None:
    # encode_feedback (M = x + e in e's memory, on the CPU a few rows of blocks at a time)
    # gives the payload, contribution and residual of encoding M whole and subtracting after,
    # and decoding chunk by chunk the mean of decoding whole: bit for bit, NaN and Inf included
    import lowcomm.compress.blocked as blocked
    from lowcomm.compress.flat import FlatLayout

    shapes = [t[0] for t in tensors]
    codecs = _bucket_codecs(tensors)
    kinds = [t[2] for t in tensors]
    xs = _bucket_input(shapes, [k if k != "nan" else "normal" for k in kinds], seed)
    for x, kind in zip(xs, kinds):
        if kind == "nan":
            x.view(-1)[seed % x.numel()] = math.nan
            x.view(-1)[(seed * 7) % x.numel()] = -math.inf
    x = torch.cat([t.reshape(-1) for t in xs])
    e = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 5)) * 0.1
    whole = FlatLayout(codecs, shapes, "cpu")
    m = x + e if feedback else x.clone()
    payload, own = whole.encode(m, generator=torch.Generator().manual_seed(seed))
    own = own.clone()
    left = torch.nan_to_num(m - own, nan=0.0, posinf=0.0, neginf=0.0)
    saved = blocked.CPU_CHUNK
    blocked.CPU_CHUNK = chunk
    try:
        chunked = FlatLayout(codecs, shapes, "cpu")
        residual, mine = e.clone(), torch.full_like(x, 7.0)
        data = chunked.encode_feedback(
            x,
            residual=residual if feedback else None,
            mine=mine,
            generator=torch.Generator().manual_seed(seed),
        )
        if "nan" not in kinds:  # (a non-finite block's codes are any bytes: its scale is not)
            assert torch.equal(data, payload)
        torch.testing.assert_close(mine, own, rtol=0, atol=0, equal_nan=True)
        if feedback:
            assert torch.equal(residual, left) and residual.isfinite().all()
        theirs = whole.encode(m * 3, generator=None)[0]
        means, expected = torch.empty_like(x), torch.empty_like(x)
        chunked.decode_mean(torch.cat([data, theirs]), 2, out=means)
    finally:
        blocked.CPU_CHUNK = saved
    FlatLayout(codecs, shapes, "cpu").decode_mean(torch.cat([payload, theirs]), 2, out=expected)
    torch.testing.assert_close(means, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_bucket_with_non_finite_values_decodes_as_its_tensors_do(bits: int) -> None:
    # a NaN or Inf makes its block's scale non-finite: every decoded value of that block is
    # NaN or infinite in both paths (the contribution is then not fed back: the residual is
    # zeroed there, and the average is skipped alike), and every other one is bit for bit
    from lowcomm.compress.flat import FlatLayout

    codec = Quantize(bits=bits)
    xs = [_x((300,)), _x((50,), 1), _x((4, 40), 2)]
    xs[0][3], xs[0][200], xs[1][7], xs[2][1, 5] = math.nan, math.inf, -math.inf, math.nan
    layout = FlatLayout([codec] * 3, [x.shape for x in xs], "cpu")
    payload, mine = layout.encode(torch.cat([x.reshape(-1) for x in xs]), generator=None)
    alone = [codec.encode(x) for x in xs]
    assert payload.numel() == sum(p.numel() for p in alone)
    means = torch.empty_like(mine)
    layout.decode_mean(torch.cat([payload, payload]), 2, out=means)
    decoded = torch.cat([codec.decode(p, x.shape).reshape(-1) for x, p in zip(xs, alone)])
    finite = torch.isfinite(decoded)
    assert torch.equal(torch.isfinite(mine), finite) and torch.equal(torch.isfinite(means), finite)
    assert torch.equal(mine[finite], decoded[finite])
    assert torch.equal(means[finite], decoded.add(decoded).div_(2.0)[finite])
    assert not finite.all()


# -- PowerSGD -----------------------------------------------------------------------------------


def test_full_rank_powersgd_equals_the_exact_mean() -> None:
    shapes = [torch.Size([6, 9]), torch.Size([5, 3]), torch.Size([4])]
    xs = [[_x(tuple(s), seed=10 * w + i) for i, s in enumerate(shapes)] for w in range(3)]
    ref = RefCompression("powersgd:6:always=1", shapes, workers=3)
    assert all(isinstance(c, PowerSGD) for c in ref.assignment[:2])
    for _ in range(2):  # also with the warm-started Q
        mean, _ = ref.mean(xs)
        for i, m in enumerate(mean):
            exact = sum(xs[w][i] for w in range(3)) / 3
            torch.testing.assert_close(m, exact, rtol=1e-5, atol=1e-5)
        # nothing left over in total (a tall matrix's per-worker column spaces differ from the
        # mean's, so single residuals need not vanish; their sum does)
        for i in range(len(shapes)):
            assert sum(ref.residuals[w][i] for w in range(3)).abs().max() < 1e-5  # type: ignore[union-attr]
        assert ref.residuals[0][0].abs().max() < 1e-5  # wide (6 × 9): P̂ spans all of R⁶


def test_powersgd_local_error_and_warm_start() -> None:
    x = _x((8, 12))
    codec = PowerSGD(2)
    s2 = torch.linalg.svdvals(x.double()) ** 2
    best = float(s2[2:].sum())  # the best rank-2 approximation's error
    cold = codec.local_error(x, codec.start_q(x.shape, 0, None))
    assert cold >= best * (1 - 1e-6)
    # started from the top right singular vectors, one round is the best approximation
    v = torch.linalg.svd(x).Vh[:2].t().contiguous()
    assert codec.local_error(x, v) == pytest.approx(best, rel=1e-4)
    low = _x((8, 2)) @ _x((2, 12), seed=1)
    assert codec.local_error(low, codec.start_q(low.shape, 0, None)) < 1e-8
    # warm start: cut or extended to the rank, with the seeded columns
    q4 = PowerSGD(4).start_q(x.shape, 3, None)
    assert torch.equal(codec.start_q(x.shape, 3, q4), q4[:, :2])
    grown = PowerSGD(4).start_q(x.shape, 3, q4[:, :2])
    assert torch.equal(grown, q4)
    fresh = PowerSGD(2, warm_start=False)
    assert not torch.equal(fresh.start_q(x.shape, 0, q4, draw=1), fresh.start_q(x.shape, 0, q4))


# -- specs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("bf16", BF16()),
        ("int8", Quantize(bits=8)),
        ("int4", Quantize(bits=4)),
        ("INT4:64:sr", Quantize(bits=4, block=64, stochastic=True)),
        ("int2:block=32", Quantize(bits=2, block=32)),
        ("sign", Sign()),
        ("sign:block=64", Sign(block=64)),
        ("SIGN:32", Sign(block=32)),
        ("topk:0.01", TopK(0.01)),
        ("topk:density=0.5", TopK(0.5)),
        ("powersgd:4", PowerSGD(4)),
        ("powersgd:rank=2:warm=0:seed=3", PowerSGD(2, warm_start=False, seed=3)),
        ("fp32", Raw()),
        ("lgreco:powersgd", LGreCo("powersgd")),
        ("lgreco:topk:0.02:every=5", LGreCo("topk", default=0.02, every=5)),
        ("lgreco:int:min_numel=16", LGreCo("int", min_numel=16)),
    ],
)
def test_specs_parse_and_round_trip(spec: str, expected: object) -> None:
    codec = parse_compression(spec)
    assert codec == expected
    assert codec is not None and parse_compression(codec.spec) == codec
    assert parse_compression(codec) is codec


def test_none_means_no_compression() -> None:
    assert parse_compression(None) is None
    assert parse_compression("none") is None


@pytest.mark.parametrize(
    "spec,fix",
    [
        ("int3", "use 'bf16', 'int8'"),
        ("zstd", "use 'bf16'"),
        ("topk", "needs a density, e.g. 'topk:0.01'"),
        ("topk:2", r"\(0, 1\]"),
        ("topk:abc", "must be a number"),
        ("powersgd:0", "e.g. 'powersgd:4'"),
        ("powersgd:x", "must be an integer"),
        ("int8:block=0", "block"),
        ("sign:block=0", "block must be >= 1"),
        ("sign:sr", "e.g. 'sign:block=64'"),
        ("int8:foo", "e.g. 'int4:block=64:sr'"),
        ("bf16:sr", "takes no options"),
        ("powersgd:4:colour=red", "unknown option"),
        ("lgreco", "needs a family"),
        ("lgreco:zip", "'lgreco:powersgd'"),
        ("lgreco:int:3", "bits must be 2, 4 or 8"),
        ("lgreco:powersgd:every=0", "every must be a positive integer"),
    ],
)
def test_bad_specs_name_the_fix(spec: str, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        parse_compression(spec)
    with pytest.raises(ValueError, match=fix):
        CO2.validate(compression=spec)


def test_compression_must_be_a_spec_or_codec() -> None:
    with pytest.raises(ValueError, match="spec string"):
        parse_compression(4)  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", [DiLoCo, CO2, StreamingDiLoCo, CoCoDC])
def test_algorithms_validate_compression(algo: type) -> None:
    with pytest.raises(ValueError, match="unknown compression"):
        algo.validate(sync_every=4, compression="int5")
    algo.validate(sync_every=4, compression="int4")


def test_eager_co2_refuses_two_phase_codecs() -> None:
    for spec in ("powersgd:2", "lgreco:powersgd"):
        with pytest.raises(ValueError, match="eager=False or a single-phase codec"):
            CO2.validate(eager=True, compression=spec)
    CO2.validate(eager=True, compression="int8")


# -- error feedback and the compressed path on one rank ---------------------------------------

CODECS = ["fp32", "bf16", "int8", "int4:16", "int2:8:sr", "sign:16", "topk:0.1", "powersgd:2"]


@pytest.mark.parametrize("spec", CODECS)
def test_error_feedback_invariant_on_one_rank(single_rank_group: None, spec: str) -> None:
    """Σ applied + residual = Σ raw inputs, every round (one rank: applied = contribution)."""
    shapes = [torch.Size([12, 10]), torch.Size([10]), torch.Size([3, 4, 5])]
    buckets = FlatBuckets(shapes, bucket_cap_mb=130 * 4 / 2**20)  # two buckets
    comm = Communicator()
    comp = Compressor(spec, shapes)
    applied = [torch.zeros(s) for s in shapes]
    raw = [torch.zeros(s) for s in shapes]
    for t in range(6):
        xs = [_x(tuple(s), seed=100 * t + i) for i, s in enumerate(shapes)]
        buckets.copy_from(xs)
        handle = comm.compressed_mean_async(buckets, comp)
        handle.wait()
        for a, r, x, v in zip(applied, raw, xs, buckets.views):
            a += v
            r += x
        for a, r, e in zip(applied, raw, comp.residuals):
            torch.testing.assert_close(a + e, r, rtol=1e-5, atol=1e-5)
    if spec == "fp32":
        assert all(e.abs().max() == 0 for e in comp.residuals)
    elif spec != "powersgd:2":
        assert any(e.abs().max() > 0 for e in comp.residuals)


@pytest.mark.parametrize("spec", CODECS)
def test_counters_count_the_compressed_bytes(single_rank_group: None, spec: str) -> None:
    shapes = [torch.Size([12, 10]), torch.Size([10]), torch.Size([3, 4, 5])]
    buckets = FlatBuckets(shapes, bucket_cap_mb=130 * 4 / 2**20)
    comm = Communicator()
    comp = Compressor(spec, shapes)
    buckets.copy_from([_x(tuple(s)) for s in shapes])
    comm.compressed_mean_async(buckets, comp).wait()
    expected = sum(parse_compression(spec).wire_nbytes(s) for s in shapes)  # type: ignore[union-attr]
    assert comm.stats.payload_bytes == comp.wire_nbytes() == expected
    assert comm.stats.wire_bytes == 0  # one rank sends nothing
    # one collective per bucket; PowerSGD a second one for each bucket holding a matrix
    # (both do here: [12 × 10, 10] and [3 × 4 × 5])
    two_phase = spec.startswith("powersgd")
    assert comm.stats.collectives == len(buckets.buffers) * (2 if two_phase else 1)


@pytest.mark.parametrize("spec", ["int4", "topk:0.1", "powersgd:2"])
def test_a_quorum_rescales_the_mean_or_leaves_a_failed_sync_undecoded(
    single_rank_group: None, spec: str
) -> None:
    """Elastic syncs (lowcomm.elastic.sync) hand a compressed mean their quorum: the decoded
    mean is multiplied by N / contributors, and a sync whose collective failed decodes nothing
    (PowerSGD launches no second phase). The residuals are those of the encoding either way."""

    class Quorum:
        def __init__(self, failed: bool, scale: float) -> None:
            self._failed, self._scale = failed, scale

        def failed(self) -> bool:
            return self._failed

        def scale(self) -> float:
            return self._scale

        def senders(self) -> torch.Tensor:
            return torch.ones(1)

    shapes = [torch.Size([12, 10]), torch.Size([10])]
    xs = [_x(tuple(s), seed=i) for i, s in enumerate(shapes)]
    out = {}
    for case, quorum in (("plain", None), ("scaled", Quorum(False, 1.5)), ("failed", None)):
        buckets = FlatBuckets(shapes)
        buckets.copy_from(xs)
        comm = Communicator()
        comp = Compressor(spec, shapes)
        handle = comm.compressed_mean_async(buckets, comp)
        handle.quorum = Quorum(True, 1.0) if case == "failed" else quorum  # type: ignore[attr-defined]
        handle.wait()
        out[case] = ([v.clone() for v in buckets.views], [e.clone() for e in comp.residuals])
        if case == "failed":
            assert comm.stats.collectives == len(buckets.buffers)  # no second phase
    for plain, scaled in zip(out["plain"][0], out["scaled"][0]):
        torch.testing.assert_close(scaled, plain * 1.5)
    for x, failed in zip(xs, out["failed"][0]):  # the send buffer as it was: not decoded
        assert torch.equal(failed, x)
    for plain, failed in zip(out["plain"][1], out["failed"][1]):
        if not spec.startswith("powersgd"):  # (PowerSGD's residual is set in its 2nd phase)
            assert torch.equal(plain, failed)


def test_a_sparse_mean_over_a_quorum_leaves_out_the_replicas_that_do_not_contribute() -> None:
    """Elastic syncs: a replica healed at the quorum sends the encoding of zeros and counts 0.
    SparseLoCo's mean over the ranks that sent each element leaves its payload out (its top-k
    of zeros would otherwise count as sent): the mean of three payloads, the third a
    non-contributor's, is that of the first two bit for bit. The tensors sent raw in the same
    bucket (too small to compress) take the quorum's N / contributors, as every other codec's
    mean does."""
    from lowcomm.compress.flat import FlatLayout
    from lowcomm.compress.sparse import Sparse, SparseSection

    codec = Sparse(density=0.125, chunk=4)
    shapes = [torch.Size([8, 8]), torch.Size([2]), torch.Size([8, 4])]
    layout = FlatLayout([codec if codec.compresses(s) else Raw() for s in shapes], shapes, "cpu")
    assert {type(s).__name__ for s in layout.sections} == {"SparseSection", "RawSection"}
    n = sum(math.prod(s) for s in shapes)
    contributions = [_x((n,), seed=1), _x((n,), seed=2), torch.zeros(n)]
    payloads = [layout.encode(x, generator=None)[0] for x in contributions]
    two, three = torch.empty(n), torch.empty(n)
    layout.decode_mean(torch.cat(payloads[:2]), 2, out=two)
    layout.decode_mean(
        torch.cat(payloads), 3, out=three, senders=torch.tensor([1.0, 1.0, 0.0]), scale=1.5
    )
    sparse = torch.zeros(n, dtype=torch.bool)
    for section in layout.sections:
        if isinstance(section, SparseSection):
            section.put(sparse, torch.ones(section.numel, dtype=torch.bool))
    assert sparse.any() and not sparse.all()
    assert torch.equal(three[sparse], two[sparse])
    torch.testing.assert_close(three[~sparse], two[~sparse])
    # counted as senders, the zeros pull the mean of elements only some ranks kept towards 0
    layout.decode_mean(torch.cat(payloads), 3, out=three)
    assert not torch.equal(three[sparse], two[sparse])


def test_without_error_feedback_nothing_is_kept(single_rank_group: None) -> None:
    shapes = [torch.Size([64])]
    buckets = FlatBuckets(shapes)
    comp = Compressor("int2", shapes, error_feedback=False)
    buckets.copy_from([_x((64,))])
    Communicator().compressed_mean_async(buckets, comp).wait()
    assert comp.residuals[0].abs().max() == 0
    assert torch.equal(buckets.views[0], Quantize(bits=2).roundtrip(_x((64,))))


def test_compressor_state_dict_round_trip(single_rank_group: None) -> None:
    shapes = [torch.Size([12, 10]), torch.Size([10])]
    comm = Communicator()

    def run(comp: Compressor, rounds: range) -> list[torch.Tensor]:
        buckets = FlatBuckets(shapes)
        out = []
        for t in rounds:
            buckets.copy_from([_x(tuple(s), seed=7 * t + i) for i, s in enumerate(shapes)])
            comm.compressed_mean_async(buckets, comp).wait()
            out += [v.clone() for v in buckets.views]
        return out

    for spec in ("int4:sr", "powersgd:2"):
        straight = run(Compressor(spec, shapes), range(4))
        first = Compressor(spec, shapes)
        head = run(first, range(2))
        second = Compressor(spec, shapes)
        second.load_state_dict(first.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(straight, head + run(second, range(2, 4))))
        with pytest.raises(ValueError, match="resume with the same compression"):
            Compressor("int8", shapes).load_state_dict(first.state_dict())


def test_every_codec_is_parsed_by_its_class_through_the_name_table() -> None:
    # one table of spec names; each class parses its own options and prints a spec that parses
    # back to it
    from lowcomm.compress.codecs import CODECS

    examples = {"topk": "topk:0.05", "powersgd": "powersgd:2:warm=0", "int4": "int4:block=64:sr"}
    for name, cls in CODECS.items():
        codec = parse_compression(examples.get(name, name))
        assert type(codec) is cls, name
        assert parse_compression(codec.spec) == codec, name
    with pytest.raises(ValueError, match="bf16 takes no options"):
        parse_compression("bf16:3")
    with pytest.raises(ValueError, match="unknown compression 'int3'"):
        parse_compression("int3")
