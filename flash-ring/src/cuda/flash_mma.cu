// flash-ring's tensor-core attention kernels for CUDA (bf16 and f16 inputs, head dims that are
// multiples of 16 up to 128), compiled at run time by NVRTC (flash_ring::cuda) after common.cuh.
//
// Contract: the same as flash.cu's (q (b, sq, hq, D), k and v (b, sk, hkv, D), contiguous and
// 16-byte aligned; out f32 (b, sq, hq, D), lse f32 (b, hq, sq); dout f32 (b, sq, hq, D); lse,
// delta f32 (b, hq, sq); dq f32 (b, sq, hq, D), dk and dv f32 (b, sk, hkv, D)), the same mask
// rule, soft-cap and empty-row convention (out = 0, lse = -inf), the same entry points and
// arguments, so the host launches either set the same way.
//
// Compile-time parameters (-D): HEAD_DIM (a multiple of 16, at most 128), ELEM_KIND (1 bf16,
// 2 f16).
//
// Layout of the work (FlashAttention-2's): a block of 4 warps owns 64 rows (query rows in the
// forward and dq kernels, key rows in the dk/dv kernel), 16 per warp, as mma.sync m16n8k16
// A-operand fragments in registers; the other side is streamed through shared memory in tiles
// of BN rows (row stride HEAD_DIM + 8 elements: the 32-bit fragment loads and ldmatrix rows are
// free of bank conflicts). Both products of a tile run on tensor cores with f32 accumulation;
// the probabilities (forward) and dS (backward) are rounded to the input type for the second
// product, as FlashAttention-2 does. The softmax runs in f32 on the accumulator fragments: a
// thread holds two rows (lane / 4 and lane / 4 + 8) and, per 8 columns, columns 2 (lane % 4)
// and 2 (lane % 4) + 1; row reductions are two shuffles over the 4 threads of a row. Tiles whose
// every pair is masked are skipped; tiles whose every pair is allowed skip the per-pair mask
// (both decided from the host's spans of positions and documents, no barrier).
// No atomics: dq and dk/dv are separate kernels, so results are deterministic.

#define BM 64                  // rows a block owns
#define DS (HEAD_DIM + 8)      // shared-memory row stride, in elements
#define KSTEPS (HEAD_DIM / 16) // k-steps of 16 over the head dim
#define DBLK (HEAD_DIM / 8)    // n-blocks of 8 over the head dim
#define CHUNKS (HEAD_DIM / 8)  // 16-byte chunks of a row

// Two floats as one register of two elements, lo in the low half.
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
#if ELEM_KIND == 1
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// c (16 x 8, f32) += a (16 x 16, row) * b (16 x 8, col).
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if ELEM_KIND == 1
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// 2^x by the hardware's approximation (relative error about 2^-22; 2^-inf = 0), as
// FlashAttention-2 does with fast math: the probabilities are rounded to bf16/f16 anyway.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// The B fragments of a (16 rows) x (16 columns) block of a row-major shared tile read as
// B[k = row][n = column]: r[0], r[1] for columns 0..7 (rows 0..7, 8..15), r[2], r[3] for columns
// 8..15. `tile` points at the block's first element; every lane passes the same pointer.
__device__ __forceinline__ void ldsm_b_trans(unsigned* r, const elem_t* tile) {
    const int lane = threadIdx.x % 32, mat = lane / 8;
    const elem_t* p = tile + ((mat & 1) * 8 + lane % 8) * DS + (mat >> 1) * 8;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// The B fragment (b0, b1) of a 16 x 8 block read as B[k = column][n = row] of a row-major shared
// tile (a row of K read as a column of K^T): `tile` points at row n0, column k0.
__device__ __forceinline__ void lds_b(unsigned& b0, unsigned& b1, const elem_t* tile) {
    const int lane = threadIdx.x % 32;
    const elem_t* p = tile + (lane / 4) * DS + (lane % 4) * 2;
    b0 = *(const unsigned*)p;
    b1 = *(const unsigned*)(p + 8);
}

// A fragments of 16 rows x HEAD_DIM of a (rows, heads, HEAD_DIM) element array: row r of the
// fragment is global row `row0 + r`, zero past `nrows`. `base` points at row 0 of the head.
__device__ __forceinline__ void load_a(unsigned (*a)[4], const elem_t* base, long row_stride,
                                       int row0, int nrows) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            int row = row0 + lane / 4 + (t & 1) * 8;
            int col = kk * 16 + (lane % 4) * 2 + (t >> 1) * 8;
            a[kk][t] = row < nrows ? *(const unsigned*)(base + row * row_stride + col) : 0u;
        }
    }
}

// The same from an f32 array, rounded to the element type.
__device__ __forceinline__ void load_a_f32(unsigned (*a)[4], const float* base, long row_stride,
                                           int row0, int nrows) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            int row = row0 + lane / 4 + (t & 1) * 8;
            int col = kk * 16 + (lane % 4) * 2 + (t >> 1) * 8;
            if (row < nrows) {
                float2 x = *(const float2*)(base + row * row_stride + col);
                a[kk][t] = pack2(x.x, x.y);
            } else {
                a[kk][t] = 0u;
            }
        }
    }
}

// Rows [r0, r0 + n) of a (rows, heads, HEAD_DIM) element array into a shared tile of `rows`
// rows, zero past n (a masked pair's zero weight must not meet uninitialised memory).
__device__ __forceinline__ void tile_rows(elem_t* dst, const elem_t* base, long row_stride,
                                          int r0, int n, int rows) {
    for (int e = threadIdx.x; e < rows * CHUNKS; e += NT) {
        int r = e / CHUNKS, c = (e % CHUNKS) * 8;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r < n) x = *(const uint4*)(base + (long)(r0 + r) * row_stride + c);
        *(uint4*)(dst + r * DS + c) = x;
    }
}

// The same from an f32 array, rounded to the element type.
__device__ __forceinline__ void tile_rows_f32(elem_t* dst, const float* base, long row_stride,
                                              int r0, int n, int rows) {
    for (int e = threadIdx.x; e < rows * CHUNKS; e += NT) {
        int r = e / CHUNKS, c = (e % CHUNKS) * 8;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r < n) {
            const float4* p = (const float4*)(base + (long)(r0 + r) * row_stride + c);
            float4 a = p[0], b = p[1];
            x = make_uint4(pack2(a.x, a.y), pack2(a.z, a.w), pack2(b.x, b.y), pack2(b.z, b.w));
        }
        *(uint4*)(dst + r * DS + c) = x;
    }
}

// Logit of a score: scaled, soft-capped when softcap > 0 (dcap: the cap's derivative).
__device__ __forceinline__ float logit(float s, float scale, float softcap, float* dcap) {
    float x = s * scale;
    *dcap = 1.f;
    if (softcap > 0.f) {
        float th = tanhf(x / softcap);
        x = softcap * th;
        *dcap = 1.f - th * th;
    }
    return x;
}

__device__ __forceinline__ float row_max4(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float row_sum4(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

#define BN_FWD 64  // key rows per tile, forward

// Forward: grid (ceil(sq / 64), hq, b), 128 threads.
extern "C" __global__ void __launch_bounds__(NT) flash_fwd(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse,
    const int* q_pos, const int* k_pos, const int* q_doc, const int* k_doc,
    const int4* q_span, const int4* k_span,
    int sq, int sk, int hq, int hkv, float scale, float softcap, int causal, int window) {
    __shared__ __align__(16) elem_t ks[BN_FWD * DS];
    __shared__ __align__(16) elem_t vs[BN_FWD * DS];
    __shared__ int kp[BN_FWD];
    __shared__ int kd[BN_FWD];
    MaskArgs m = {q_pos, k_pos, q_doc, k_doc, causal, window};
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (hq / hkv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i0 = blockIdx.x * BM;
    const int w0 = i0 + warp * 16;        // the warp's first row
    const int c0 = (lane % 4) * 2;        // the thread's first column of an 8-column block
    const long qstride = (long)hq * HEAD_DIM, kstride = (long)hkv * HEAD_DIM;
    unsigned qf[KSTEPS][4];
    load_a(qf, q + ((long)b * sq * hq + h) * HEAD_DIM, qstride, w0, sq);
    int pq[2], dq[2];
    bool rv[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        int row = w0 + lane / 4 + t * 8;
        rv[t] = row < sq;
        pq[t] = rv[t] ? q_pos[row] : 0;
        dq[t] = (rv[t] && q_doc != 0) ? q_doc[row] : 0;
    }
    float o[DBLK][4];
#pragma unroll
    for (int j = 0; j < DBLK; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float mx[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int nq = min(BM, sq - i0);
    const Span qspan = tile_span(q_span, i0, nq);
    const elem_t* kb = k + ((long)b * sk * hkv + hk) * HEAD_DIM;
    const elem_t* vb = v + ((long)b * sk * hkv + hk) * HEAD_DIM;
    for (int j0 = 0; j0 < sk; j0 += BN_FWD) {
        const int n = min(BN_FWD, sk - j0);
        const Span kspan = tile_span(k_span, j0, n);
        if (disjoint(m, qspan, kspan)) continue;  // uniform over the block
        const bool full = n == BN_FWD && nq == BM && covers(m, qspan, kspan);
        for (int r = threadIdx.x; r < BN_FWD; r += NT) {
            kp[r] = r < n ? k_pos[j0 + r] : 0;
            kd[r] = (r < n && k_doc != 0) ? k_doc[j0 + r] : 0;
        }
        tile_rows(ks, kb, kstride, j0, n, BN_FWD);
        tile_rows(vs, vb, kstride, j0, n, BN_FWD);
        __syncthreads();
        float s[BN_FWD / 8][4];
#pragma unroll
        for (int nb = 0; nb < BN_FWD / 8; ++nb) {
            s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                unsigned b0, b1;
                lds_b(b0, b1, ks + nb * 8 * DS + kk * 16);
                mma(s[nb], qf[kk], b0, b1);
            }
        }
        float tmax[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nb = 0; nb < BN_FWD / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = e >> 1, col = nb * 8 + c0 + (e & 1);
                float dcap;
                float x = logit(s[nb][e], scale, softcap, &dcap);
                if (!full && !(rv[t] && col < n && allowed(m, pq[t], kp[col], dq[t], kd[col])))
                    x = NEG_INF;
                s[nb][e] = x;
                tmax[t] = fmaxf(tmax[t], x);
            }
        }
        float mu[2];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const float mnew = fmaxf(mx[t], row_max4(tmax[t]));
            const float alpha = mnew == NEG_INF ? 1.f : exp2_approx((mx[t] - mnew) * LOG2E);
            mu[t] = mnew == NEG_INF ? 0.f : mnew;
            mx[t] = mnew;
            l[t] *= alpha;
#pragma unroll
            for (int j = 0; j < DBLK; ++j) {
                o[j][2 * t] *= alpha;
                o[j][2 * t + 1] *= alpha;
            }
        }
#pragma unroll
        for (int nb = 0; nb < BN_FWD / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = e >> 1;
                const float p = exp2_approx((s[nb][e] - mu[t]) * LOG2E);
                l[t] += p;
                s[nb][e] = p;
            }
        }
#pragma unroll
        for (int kk = 0; kk < BN_FWD / 16; ++kk) {
            const unsigned pa[4] = {pack2(s[2 * kk][0], s[2 * kk][1]),
                                    pack2(s[2 * kk][2], s[2 * kk][3]),
                                    pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 16; ++j) {
                unsigned vf[4];
                ldsm_b_trans(vf, vs + kk * 16 * DS + j * 16);
                mma(o[2 * j], pa, vf[0], vf[1]);
                mma(o[2 * j + 1], pa, vf[2], vf[3]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int row = w0 + lane / 4 + t * 8;
        const float lt = row_sum4(l[t]);
        // A NaN score leaves lt NaN: the row's out and lse are NaN (as on the CPU).
        const float inv = lt > 0.f ? 1.f / lt : (isnan(lt) ? lt : 0.f);
        if (row < sq) {
            float* orow = out + (((long)b * sq + row) * hq + h) * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < DBLK; ++j) {
                *(float2*)(orow + j * 8 + c0) = make_float2(o[j][2 * t] * inv, o[j][2 * t + 1] * inv);
            }
            if (lane % 4 == 0) lse[((long)b * hq + h) * sq + row] = lt > 0.f ? mx[t] + logf(lt) : (isnan(lt) ? lt : NEG_INF);
        }
    }
}

#define BN_DQ 32  // key rows per tile, dq

// dq: grid (ceil(sq / 64), hq, b). dS = P (dP - delta) with P = exp(logit - lse), dP = dO V^T;
// dq = dS K (times the scale and the soft-cap's derivative).
extern "C" __global__ void __launch_bounds__(NT) flash_bwd_dq(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
    const float* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ delta, float* __restrict__ dq_out,
    const int* q_pos, const int* k_pos, const int* q_doc, const int* k_doc,
    const int4* q_span, const int4* k_span,
    int sq, int sk, int hq, int hkv, float scale, float softcap, int causal, int window) {
    __shared__ __align__(16) elem_t ks[BN_DQ * DS];
    __shared__ __align__(16) elem_t vs[BN_DQ * DS];
    __shared__ int kp[BN_DQ];
    __shared__ int kd[BN_DQ];
    MaskArgs m = {q_pos, k_pos, q_doc, k_doc, causal, window};
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (hq / hkv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int i0 = blockIdx.x * BM;
    const int w0 = i0 + warp * 16;
    const int c0 = (lane % 4) * 2;
    const long qstride = (long)hq * HEAD_DIM, kstride = (long)hkv * HEAD_DIM;
    unsigned qf[KSTEPS][4], df[KSTEPS][4];
    load_a(qf, q + ((long)b * sq * hq + h) * HEAD_DIM, qstride, w0, sq);
    load_a_f32(df, dout + ((long)b * sq * hq + h) * HEAD_DIM, qstride, w0, sq);
    int pq[2], dq[2];
    bool rv[2];
    float li[2], di[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        int row = w0 + lane / 4 + t * 8;
        rv[t] = row < sq;
        pq[t] = rv[t] ? q_pos[row] : 0;
        dq[t] = (rv[t] && q_doc != 0) ? q_doc[row] : 0;
        li[t] = rv[t] ? lse[((long)b * hq + h) * sq + row] : NEG_INF;
        di[t] = rv[t] ? delta[((long)b * hq + h) * sq + row] : 0.f;
    }
    float acc[DBLK][4];
#pragma unroll
    for (int j = 0; j < DBLK; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const int nq = min(BM, sq - i0);
    const Span qspan = tile_span(q_span, i0, nq);
    const elem_t* kb = k + ((long)b * sk * hkv + hk) * HEAD_DIM;
    const elem_t* vb = v + ((long)b * sk * hkv + hk) * HEAD_DIM;
    for (int j0 = 0; j0 < sk; j0 += BN_DQ) {
        const int n = min(BN_DQ, sk - j0);
        const Span kspan = tile_span(k_span, j0, n);
        if (disjoint(m, qspan, kspan)) continue;
        const bool full = n == BN_DQ && nq == BM && covers(m, qspan, kspan);
        for (int r = threadIdx.x; r < BN_DQ; r += NT) {
            kp[r] = r < n ? k_pos[j0 + r] : 0;
            kd[r] = (r < n && k_doc != 0) ? k_doc[j0 + r] : 0;
        }
        tile_rows(ks, kb, kstride, j0, n, BN_DQ);
        tile_rows(vs, vb, kstride, j0, n, BN_DQ);
        __syncthreads();
        float s[BN_DQ / 8][4], dp[BN_DQ / 8][4];
#pragma unroll
        for (int nb = 0; nb < BN_DQ / 8; ++nb) {
            s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
            dp[nb][0] = dp[nb][1] = dp[nb][2] = dp[nb][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; ++kk) {
                unsigned b0, b1;
                lds_b(b0, b1, ks + nb * 8 * DS + kk * 16);
                mma(s[nb], qf[kk], b0, b1);
                lds_b(b0, b1, vs + nb * 8 * DS + kk * 16);
                mma(dp[nb], df[kk], b0, b1);
            }
        }
#pragma unroll
        for (int nb = 0; nb < BN_DQ / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = e >> 1, col = nb * 8 + c0 + (e & 1);
                float dcap;
                const float x = logit(s[nb][e], scale, softcap, &dcap);
                const bool ok = li[t] != NEG_INF &&
                    (full || (rv[t] && col < n && allowed(m, pq[t], kp[col], dq[t], kd[col])));
                const float p = ok ? exp2_approx((x - li[t]) * LOG2E) : 0.f;
                s[nb][e] = p * (dp[nb][e] - di[t]) * dcap * scale;
            }
        }
#pragma unroll
        for (int kk = 0; kk < BN_DQ / 16; ++kk) {
            const unsigned da[4] = {pack2(s[2 * kk][0], s[2 * kk][1]),
                                    pack2(s[2 * kk][2], s[2 * kk][3]),
                                    pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 16; ++j) {
                unsigned kf[4];
                ldsm_b_trans(kf, ks + kk * 16 * DS + j * 16);
                mma(acc[2 * j], da, kf[0], kf[1]);
                mma(acc[2 * j + 1], da, kf[2], kf[3]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int row = w0 + lane / 4 + t * 8;
        if (row < sq) {
            float* drow = dq_out + (((long)b * sq + row) * hq + h) * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < DBLK; ++j) {
                *(float2*)(drow + j * 8 + c0) = make_float2(acc[j][2 * t], acc[j][2 * t + 1]);
            }
        }
    }
}

#define BQ_DKDV 16  // query rows per tile, dk/dv

// dk, dv: grid (ceil(sk / 64), hkv, b); each key row sums over every q head of its group. The
// transposed products: S^T = K Q^T, dP^T = V dO^T, dv += P^T dO, dk += dS^T Q.
extern "C" __global__ void __launch_bounds__(NT) flash_bwd_dkdv(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
    const float* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ delta, float* __restrict__ dk_out, float* __restrict__ dv_out,
    const int* q_pos, const int* k_pos, const int* q_doc, const int* k_doc,
    const int4* q_span, const int4* k_span,
    int sq, int sk, int hq, int hkv, float scale, float softcap, int causal, int window) {
    __shared__ __align__(16) elem_t qs[BQ_DKDV * DS];
    __shared__ __align__(16) elem_t dos[BQ_DKDV * DS];
    __shared__ int qp[BQ_DKDV];
    __shared__ int qd[BQ_DKDV];
    __shared__ float ls[BQ_DKDV];
    __shared__ float dl[BQ_DKDV];
    MaskArgs m = {q_pos, k_pos, q_doc, k_doc, causal, window};
    const int b = blockIdx.z, hk = blockIdx.y, group = hq / hkv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int j0 = blockIdx.x * BM;
    const int w0 = j0 + warp * 16;
    const int c0 = (lane % 4) * 2;
    const long qstride = (long)hq * HEAD_DIM, kstride = (long)hkv * HEAD_DIM;
    unsigned kf[KSTEPS][4], vf[KSTEPS][4];
    load_a(kf, k + ((long)b * sk * hkv + hk) * HEAD_DIM, kstride, w0, sk);
    load_a(vf, v + ((long)b * sk * hkv + hk) * HEAD_DIM, kstride, w0, sk);
    int pk[2], dk[2];
    bool rv[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        int row = w0 + lane / 4 + t * 8;
        rv[t] = row < sk;
        pk[t] = rv[t] ? k_pos[row] : 0;
        dk[t] = (rv[t] && k_doc != 0) ? k_doc[row] : 0;
    }
    float dka[DBLK][4], dva[DBLK][4];
#pragma unroll
    for (int j = 0; j < DBLK; ++j) {
        dka[j][0] = dka[j][1] = dka[j][2] = dka[j][3] = 0.f;
        dva[j][0] = dva[j][1] = dva[j][2] = dva[j][3] = 0.f;
    }
    const int nk = min(BM, sk - j0);
    const Span kspan = tile_span(k_span, j0, nk);
    for (int h = hk * group; h < (hk + 1) * group; ++h) {
        const elem_t* qb = q + ((long)b * sq * hq + h) * HEAD_DIM;
        const float* ob = dout + ((long)b * sq * hq + h) * HEAD_DIM;
        for (int i0 = 0; i0 < sq; i0 += BQ_DKDV) {
            const int n = min(BQ_DKDV, sq - i0);
            const Span qspan = tile_span(q_span, i0, n);
            if (disjoint(m, qspan, kspan)) continue;
            const bool full = n == BQ_DKDV && nk == BM && covers(m, qspan, kspan);
            for (int r = threadIdx.x; r < BQ_DKDV; r += NT) {
                const bool in = r < n;
                const long roff = ((long)b * hq + h) * sq + i0 + r;
                qp[r] = in ? q_pos[i0 + r] : 0;
                qd[r] = (in && q_doc != 0) ? q_doc[i0 + r] : 0;
                ls[r] = in ? lse[roff] : NEG_INF;
                dl[r] = in ? delta[roff] : 0.f;
            }
            tile_rows(qs, qb, qstride, i0, n, BQ_DKDV);
            tile_rows_f32(dos, ob, qstride, i0, n, BQ_DKDV);
            __syncthreads();
            float st[BQ_DKDV / 8][4], dpt[BQ_DKDV / 8][4];
#pragma unroll
            for (int nb = 0; nb < BQ_DKDV / 8; ++nb) {
                st[nb][0] = st[nb][1] = st[nb][2] = st[nb][3] = 0.f;
                dpt[nb][0] = dpt[nb][1] = dpt[nb][2] = dpt[nb][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk) {
                    unsigned b0, b1;
                    lds_b(b0, b1, qs + nb * 8 * DS + kk * 16);
                    mma(st[nb], kf[kk], b0, b1);
                    lds_b(b0, b1, dos + nb * 8 * DS + kk * 16);
                    mma(dpt[nb], vf[kk], b0, b1);
                }
            }
#pragma unroll
            for (int nb = 0; nb < BQ_DKDV / 8; ++nb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int t = e >> 1, col = nb * 8 + c0 + (e & 1);
                    float dcap;
                    const float x = logit(st[nb][e], scale, softcap, &dcap);
                    const bool ok = ls[col] != NEG_INF &&
                        (full || (rv[t] && col < n && allowed(m, qp[col], pk[t], qd[col], dk[t])));
                    const float p = ok ? exp2_approx((x - ls[col]) * LOG2E) : 0.f;
                    st[nb][e] = p;
                    dpt[nb][e] = p * (dpt[nb][e] - dl[col]) * dcap * scale;
                }
            }
#pragma unroll
            for (int kk = 0; kk < BQ_DKDV / 16; ++kk) {
                const unsigned pa[4] = {pack2(st[2 * kk][0], st[2 * kk][1]),
                                        pack2(st[2 * kk][2], st[2 * kk][3]),
                                        pack2(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                        pack2(st[2 * kk + 1][2], st[2 * kk + 1][3])};
                const unsigned da[4] = {pack2(dpt[2 * kk][0], dpt[2 * kk][1]),
                                        pack2(dpt[2 * kk][2], dpt[2 * kk][3]),
                                        pack2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                        pack2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
                for (int j = 0; j < HEAD_DIM / 16; ++j) {
                    unsigned f[4];
                    ldsm_b_trans(f, dos + kk * 16 * DS + j * 16);
                    mma(dva[2 * j], pa, f[0], f[1]);
                    mma(dva[2 * j + 1], pa, f[2], f[3]);
                    ldsm_b_trans(f, qs + kk * 16 * DS + j * 16);
                    mma(dka[2 * j], da, f[0], f[1]);
                    mma(dka[2 * j + 1], da, f[2], f[3]);
                }
            }
            __syncthreads();
        }
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int row = w0 + lane / 4 + t * 8;
        if (row < sk) {
            const long off = (((long)b * sk + row) * hkv + hk) * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < DBLK; ++j) {
                *(float2*)(dk_out + off + j * 8 + c0) = make_float2(dka[j][2 * t], dka[j][2 * t + 1]);
                *(float2*)(dv_out + off + j * 8 + c0) = make_float2(dva[j][2 * t], dva[j][2 * t + 1]);
            }
        }
    }
}
