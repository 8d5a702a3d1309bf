"""Where the per-token HQ kernel's time goes: variants of it, timed from CUDA-graph replays.

Why: Nsight Compute says the kernel is bound by instruction issue (71% of issue slots, 31%
of DRAM at 8192 x 11008 on an H200), so the question is which instructions. Each variant
is the production kernel's code (``hadamard._hq_token_kernel``) with one part changed:
16-bit uniforms (the map before 2026-11-26) at 10, 7 or 6 Philox rounds, no random bits
(u = 0.5), production's 8-bit uniforms (one Philox call per 16 elements), no quantize or
store. The 8-bit variant is checked bit-identical to production (``r10`` was, when the
results of 2026-11-26T0110 were taken, with its own 8-bit probe in another byte order);
the others are timing probes, not kernels to use.

    python bench/hq_variants.py bench/results
"""
import json, os, sys
import torch, triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layers import bench_graph
from hotcompile.kernels import hadamard as H
from hotcompile.kernels.reference import PHILOX_ROUNDS
from hotcompile.kernels.hadamard import (_load_fwht_rows, abs_bits, scale_from_amax_bits, quantize,
                                         store_levels, philox_uniform8, token_tile)


@triton.jit
def _halfwords_as_floats(w):
    """The 16-bit uniforms' helper before 2026-11-26 (half-words at the top of a mantissa)."""
    lo = ((w << 7) & 0x7FFF80) | 0x3F800000
    hi = ((w >> 9) & 0x7FFF80) | 0x3F800000
    return lo, hi


@triton.jit
def _u16(seed, rows, col0, groups_per_row, BC: tl.constexpr, ROUNDS: tl.constexpr):
    BR: tl.constexpr = rows.shape[0]
    groups = col0 // 8 + tl.arange(0, BC // 8)
    counter = (rows.to(tl.int64)[:, None] * groups_per_row + groups[None, :]).to(tl.uint32)
    w0, w1, w2, w3 = tl.randint4x(seed, counter, ROUNDS)
    lo0, hi0 = _halfwords_as_floats(w0)
    lo1, hi1 = _halfwords_as_floats(w1)
    lo2, hi2 = _halfwords_as_floats(w2)
    lo3, hi3 = _halfwords_as_floats(w3)
    lo = tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3))
    hi = tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3))
    bits = tl.reshape(tl.join(lo, hi), (BR, BC))
    return bits.to(tl.float32, bitcast=True) - 0.99999237060546875


@triton.jit
def _qstore(q_ptr, v, s, inv_s, seed, rows, col0, L, O_pad, ldq, groups, BC: tl.constexpr,
            MODE: tl.constexpr, ROUNDS: tl.constexpr):
    if MODE == 0:
        u = _u16(seed, rows, col0, groups, BC, ROUNDS)
    elif MODE == 1:
        u = 0.5
    else:      # production's 8-bit uniforms (reference.PHILOX_ROUNDS rounds)
        u = philox_uniform8(seed, rows, col0, groups // 2, BC)
    q = quantize(v, s, inv_s, u, 7, False, False)
    cols = col0 + tl.arange(0, BC)
    mask = (rows < L)[:, None] & (cols < O_pad)[None, :]
    if MODE == 3:
        pass
    else:
        store_levels(q_ptr + rows.to(tl.int64)[:, None] * ldq + cols[None, :], q, mask, True)


@triton.jit
def _k(g_ptr, q_ptr, s_ptr, seed_ptr, L, O, O_pad, stride_g, ldq, groups, BR: tl.constexpr,
       BC: tl.constexpr, ONE_TILE: tl.constexpr, MODE: tl.constexpr, ROUNDS: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    seed = tl.load(seed_ptr)
    if ONE_TILE:
        v = _load_fwht_rows(g_ptr, rows, 0, L, O, stride_g, BC)
        s = scale_from_amax_bits(tl.max(abs_bits(v), axis=1), 7)
        inv_s = tl.math.div_rn(1.0, s)
        _qstore(q_ptr, v, s[:, None], inv_s[:, None], seed, rows, 0, L, O_pad, ldq, groups, BC,
                MODE, ROUNDS)
    else:
        amax = tl.zeros((BR, BC), dtype=tl.int32)
        for col0 in range(0, O_pad, BC):
            amax = tl.maximum(amax, abs_bits(_load_fwht_rows(g_ptr, rows, col0, L, O, stride_g, BC)))
        s = scale_from_amax_bits(tl.max(amax, axis=1), 7)
        inv_s = tl.math.div_rn(1.0, s)
        for col0 in range(0, O_pad, BC):
            v = _load_fwht_rows(g_ptr, rows, col0, L, O, stride_g, BC)
            _qstore(q_ptr, v, s[:, None], inv_s[:, None], seed, rows, col0, L, O_pad, ldq, groups,
                    BC, MODE, ROUNDS)
    tl.store(s_ptr + rows, s, mask=rows < L)


def variant(mode, rounds, force=None):
    def run(g):
        L, O = g.shape
        O_pad = -(-O // 16) * 16
        q = torch.empty((L, O_pad), dtype=torch.float8_e4m3fn, device=g.device)
        s = torch.empty((L,), dtype=torch.float32, device=g.device)
        seed = torch.full((1,), 7, dtype=torch.int64, device=g.device)
        bc, chunks, br, warps = force or token_tile(O_pad, False)
        one = chunks == 1      # this copy holds one chunk at most; more: two sweeps
        _k[(triton.cdiv(L, br),)](g, q, s, seed, L, O, O_pad, g.stride(0), O_pad, O_pad // 8,
                                   BR=br, BC=bc, ONE_TILE=one, MODE=mode, ROUNDS=rounds,
                                   num_warps=warps)
        return q, s
    return run


def main(out):
    res = {"device": torch.cuda.get_device_name()}
    for L, O in ((8192, 4096), (8192, 11008), (12608, 3072)):
        sets = [((torch.randn(L, O, device="cuda") * 1e-3).bfloat16(),) for _ in range(4)]
        prod = lambda g: H.hq_act_quant(g, 4, True, 7, fp8=True)
        q0, s0 = prod(sets[0][0])
        q1, s1 = variant(2, PHILOX_ROUNDS)(sets[0][0])
        same = bool(torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1))
        nbytes = 2 * L * O + L * O
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        row = {"copy": bench_graph(lambda: dst.copy_(src), [()]), "prod": bench_graph(prod, sets),
               "u8_variant_equals_prod": same}
        for name, m, r in (("r10", 0, 10), ("r7", 0, 7), ("r6", 0, 6), ("norng", 1, 10),
                           ("u8_r7_production", 2, PHILOX_ROUNDS), ("nostore", 3, 10)):
            row[name] = bench_graph(variant(m, r), sets)
        res[f"{L}x{O}"] = row
        print(L, O, json.dumps(row), flush=True)
    json.dump(res, open(os.path.join(out, "diag_hq.json"), "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
