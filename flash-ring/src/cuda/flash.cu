// flash-ring's attention kernels for CUDA, compiled at run time by NVRTC (flash_ring::cuda).
//
// Contract (the crate's, see lib.rs and spec.rs): q (b, sq, hq, D), k and v (b, sk, hkv, D),
// contiguous, element type ELEM (float, or the 16 bits of a bf16/f16); out (b, sq, hq, D) f32,
// lse (b, hq, sq) f32 natural log; a row with no allowed key gets out = 0, lse = -inf.
// A query at global position pq may attend a key at pk iff
//   (!causal || pk <= pq) && (window < 0 || |pq - pk| < window) && (!docs || qdoc == kdoc);
// logits are s = scale * q.k, or c * tanh(s / c) with a soft-cap c > 0.
//
// Compile-time parameters (-D): HEAD_DIM (D), ELEM_KIND (0 f32, 1 bf16, 2 f16), G (threads per
// row, a power of two <= 32 with D <= 32 G), BT (rows of the other side per shared-memory tile).
// common.cuh (the element type, the mask rule, tile spans) is prepended.
//
// Layout of the work: a block of NT = 128 threads owns ROWS = NT / G rows (query rows in the
// forward and dq kernels, key rows in the dk/dv kernel); the G threads of a row each hold the
// dims d = t * G + lane of it in registers, so the rows of a warp read one shared-memory row
// at consecutive addresses (no bank conflicts) and a dot product is G partial sums reduced by
// shuffles. The other side is streamed through shared memory BT rows at a time, converted to
// f32. Tiles whose every pair is masked (by causality, window or documents) are skipped as a
// whole. Arithmetic is f32 on CUDA cores (no tensor cores): this is the correct, untuned kernel.
// No atomics anywhere: dq and dk/dv are separate kernels, so results are deterministic.

#define ROWS (NT / G)
#define DL ((HEAD_DIM + G - 1) / G)

__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int off = G / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off, G);
    return x;
}

// Forward: grid (ceil(sq / ROWS), hq, b), NT threads.
extern "C" __global__ void __launch_bounds__(NT) flash_fwd(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
    float* __restrict__ out, float* __restrict__ lse,
    const int* q_pos, const int* k_pos, const int* q_doc, const int* k_doc,
    const int4* q_span, const int4* k_span,
    int sq, int sk, int hq, int hkv, float scale, float softcap, int causal, int window) {
    __shared__ float ks[BT][HEAD_DIM];
    __shared__ float vs[BT][HEAD_DIM];
    __shared__ int kp[BT];
    __shared__ int kd[BT];
    MaskArgs m = {q_pos, k_pos, q_doc, k_doc, causal, window};
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (hq / hkv);
    const int lane = threadIdx.x % G;
    const int i0 = blockIdx.x * ROWS;
    const int i = i0 + threadIdx.x / G;
    const bool valid = i < sq;
    const long qoff = (((long)b * sq + (valid ? i : 0)) * hq + h) * HEAD_DIM;
    float qr[DL], acc[DL];
#pragma unroll
    for (int t = 0; t < DL; ++t) {
        int d = t * G + lane;
        qr[t] = (valid && d < HEAD_DIM) ? load_elem(q + qoff + d) : 0.f;
        acc[t] = 0.f;
    }
    const int pq = valid ? q_pos[i] : 0;
    const int dq = (valid && q_doc != 0) ? q_doc[i] : 0;
    const Span qspan = tile_span(q_span, i0, min(ROWS, sq - i0));
    float mx = NEG_INF, l = 0.f;
    for (int j0 = 0; j0 < sk; j0 += BT) {
        const int n = min(BT, sk - j0);
        const Span kspan = tile_span(k_span, j0, n);
        if (disjoint(m, qspan, kspan)) continue;  // uniform over the block
        for (int r = threadIdx.x; r < BT; r += NT) {
            kp[r] = r < n ? k_pos[j0 + r] : 0;
            kd[r] = (r < n && k_doc != 0) ? k_doc[j0 + r] : 0;
        }
        // Rows past n are zero: a masked pair's 0 weight must not meet uninitialised memory.
        for (int e = threadIdx.x; e < BT * HEAD_DIM; e += NT) {
            int r = e / HEAD_DIM, d = e % HEAD_DIM;
            long off = (((long)b * sk + j0 + r) * hkv + hk) * HEAD_DIM + d;
            ks[r][d] = r < n ? load_elem(k + off) : 0.f;
            vs[r][d] = r < n ? load_elem(v + off) : 0.f;
        }
        __syncthreads();
        float s[BT];
        float tmax = NEG_INF;
#pragma unroll
        for (int r = 0; r < BT; ++r) {
            float p = 0.f;
#pragma unroll
            for (int t = 0; t < DL; ++t) {
                int d = t * G + lane;
                if (d < HEAD_DIM) p += qr[t] * ks[r][d];
            }
            p = group_sum(p) * scale;
            if (softcap > 0.f) p = softcap * tanhf(p / softcap);
            bool ok = valid && r < n && allowed(m, pq, kp[r], dq, kd[r]);
            s[r] = ok ? p : NEG_INF;
            tmax = fmaxf(tmax, s[r]);
        }
        if (tmax != NEG_INF) {
            float mnew = fmaxf(mx, tmax);
            float alpha = (mx == NEG_INF) ? 0.f : expf(mx - mnew);
            l *= alpha;
#pragma unroll
            for (int t = 0; t < DL; ++t) acc[t] *= alpha;
#pragma unroll
            for (int r = 0; r < BT; ++r) {
                float p = (s[r] == NEG_INF) ? 0.f : expf(s[r] - mnew);
                l += p;
#pragma unroll
                for (int t = 0; t < DL; ++t) {
                    int d = t * G + lane;
                    if (d < HEAD_DIM) acc[t] += p * vs[r][d];
                }
            }
            mx = mnew;
        }
        __syncthreads();
    }
    if (!valid) return;
    const long ooff = (((long)b * sq + i) * hq + h) * HEAD_DIM;
    // A NaN score leaves l NaN: the row's out and lse are NaN (as on the CPU).
    const float inv = l > 0.f ? 1.f / l : (isnan(l) ? l : 0.f);
#pragma unroll
    for (int t = 0; t < DL; ++t) {
        int d = t * G + lane;
        if (d < HEAD_DIM) out[ooff + d] = acc[t] * inv;
    }
    if (lane == 0) lse[((long)b * hq + h) * sq + i] = l > 0.f ? mx + logf(l) : (isnan(l) ? l : NEG_INF);
}

// dq: grid (ceil(sq / ROWS), hq, b). dout f32 (b, sq, hq, D); lse, delta (b, hq, sq) f32 with
// delta = rowsum(dout * out). Writes dq f32 (b, sq, hq, D).
extern "C" __global__ void __launch_bounds__(NT) flash_bwd_dq(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
    const float* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ delta, float* __restrict__ dq_out,
    const int* q_pos, const int* k_pos, const int* q_doc, const int* k_doc,
    const int4* q_span, const int4* k_span,
    int sq, int sk, int hq, int hkv, float scale, float softcap, int causal, int window) {
    __shared__ float ks[BT][HEAD_DIM];
    __shared__ float vs[BT][HEAD_DIM];
    __shared__ int kp[BT];
    __shared__ int kd[BT];
    MaskArgs m = {q_pos, k_pos, q_doc, k_doc, causal, window};
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (hq / hkv);
    const int lane = threadIdx.x % G;
    const int i0 = blockIdx.x * ROWS;
    const int i = i0 + threadIdx.x / G;
    const bool valid = i < sq;
    const long qoff = (((long)b * sq + (valid ? i : 0)) * hq + h) * HEAD_DIM;
    float qr[DL], dor[DL], acc[DL];
#pragma unroll
    for (int t = 0; t < DL; ++t) {
        int d = t * G + lane;
        bool in = valid && d < HEAD_DIM;
        qr[t] = in ? load_elem(q + qoff + d) : 0.f;
        dor[t] = in ? dout[qoff + d] : 0.f;
        acc[t] = 0.f;
    }
    const int pq = valid ? q_pos[i] : 0;
    const int dqd = (valid && q_doc != 0) ? q_doc[i] : 0;
    const long roff = ((long)b * hq + h) * sq + (valid ? i : 0);
    const float li = valid ? lse[roff] : NEG_INF;
    const float di = valid ? delta[roff] : 0.f;
    const Span qspan = tile_span(q_span, i0, min(ROWS, sq - i0));
    for (int j0 = 0; j0 < sk; j0 += BT) {
        const int n = min(BT, sk - j0);
        const Span kspan = tile_span(k_span, j0, n);
        if (disjoint(m, qspan, kspan)) continue;
        for (int r = threadIdx.x; r < BT; r += NT) {
            kp[r] = r < n ? k_pos[j0 + r] : 0;
            kd[r] = (r < n && k_doc != 0) ? k_doc[j0 + r] : 0;
        }
        // Rows past n are zero: a masked pair's 0 weight must not meet uninitialised memory.
        for (int e = threadIdx.x; e < BT * HEAD_DIM; e += NT) {
            int r = e / HEAD_DIM, d = e % HEAD_DIM;
            long off = (((long)b * sk + j0 + r) * hkv + hk) * HEAD_DIM + d;
            ks[r][d] = r < n ? load_elem(k + off) : 0.f;
            vs[r][d] = r < n ? load_elem(v + off) : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int r = 0; r < BT; ++r) {
            float s = 0.f, dp = 0.f;
#pragma unroll
            for (int t = 0; t < DL; ++t) {
                int d = t * G + lane;
                if (d < HEAD_DIM) { s += qr[t] * ks[r][d]; dp += dor[t] * vs[r][d]; }
            }
            s = group_sum(s) * scale;
            dp = group_sum(dp);
            float dcap = 1.f;
            if (softcap > 0.f) { float th = tanhf(s / softcap); s = softcap * th; dcap = 1.f - th * th; }
            bool ok = valid && r < n && li != NEG_INF && allowed(m, pq, kp[r], dqd, kd[r]);
            float p = ok ? expf(s - li) : 0.f;
            float ds = p * (dp - di) * dcap * scale;
#pragma unroll
            for (int t = 0; t < DL; ++t) {
                int d = t * G + lane;
                if (d < HEAD_DIM) acc[t] += ds * ks[r][d];
            }
        }
        __syncthreads();
    }
    if (!valid) return;
#pragma unroll
    for (int t = 0; t < DL; ++t) {
        int d = t * G + lane;
        if (d < HEAD_DIM) dq_out[qoff + d] = acc[t];
    }
}

// dk, dv: grid (ceil(sk / ROWS), hkv, b); each key row sums over every q head of its group.
// Writes dk, dv f32 (b, sk, hkv, D).
extern "C" __global__ void __launch_bounds__(NT) flash_bwd_dkdv(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
    const float* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ delta, float* __restrict__ dk_out, float* __restrict__ dv_out,
    const int* q_pos, const int* k_pos, const int* q_doc, const int* k_doc,
    const int4* q_span, const int4* k_span,
    int sq, int sk, int hq, int hkv, float scale, float softcap, int causal, int window) {
    __shared__ float qs[BT][HEAD_DIM];
    __shared__ float dos[BT][HEAD_DIM];
    __shared__ int qp[BT];
    __shared__ int qd[BT];
    __shared__ float ls[BT];
    __shared__ float dl[BT];
    MaskArgs m = {q_pos, k_pos, q_doc, k_doc, causal, window};
    const int b = blockIdx.z, hk = blockIdx.y, group = hq / hkv;
    const int lane = threadIdx.x % G;
    const int j0 = blockIdx.x * ROWS;
    const int j = j0 + threadIdx.x / G;
    const bool valid = j < sk;
    const long koff = (((long)b * sk + (valid ? j : 0)) * hkv + hk) * HEAD_DIM;
    float kr[DL], vr[DL], dk[DL], dv[DL];
#pragma unroll
    for (int t = 0; t < DL; ++t) {
        int d = t * G + lane;
        bool in = valid && d < HEAD_DIM;
        kr[t] = in ? load_elem(k + koff + d) : 0.f;
        vr[t] = in ? load_elem(v + koff + d) : 0.f;
        dk[t] = 0.f;
        dv[t] = 0.f;
    }
    const int pk = valid ? k_pos[j] : 0;
    const int dkd = (valid && k_doc != 0) ? k_doc[j] : 0;
    const Span kspan = tile_span(k_span, j0, min(ROWS, sk - j0));
    for (int h = hk * group; h < (hk + 1) * group; ++h) {
        for (int i0 = 0; i0 < sq; i0 += BT) {
            const int n = min(BT, sq - i0);
            const Span qspan = tile_span(q_span, i0, n);
            if (disjoint(m, qspan, kspan)) continue;
            for (int r = threadIdx.x; r < BT; r += NT) {
                bool in = r < n;
                qp[r] = in ? q_pos[i0 + r] : 0;
                qd[r] = (in && q_doc != 0) ? q_doc[i0 + r] : 0;
                long roff = ((long)b * hq + h) * sq + i0 + r;
                ls[r] = in ? lse[roff] : NEG_INF;
                dl[r] = in ? delta[roff] : 0.f;
            }
            for (int e = threadIdx.x; e < BT * HEAD_DIM; e += NT) {
                int r = e / HEAD_DIM, d = e % HEAD_DIM;
                long off = (((long)b * sq + i0 + r) * hq + h) * HEAD_DIM + d;
                qs[r][d] = r < n ? load_elem(q + off) : 0.f;
                dos[r][d] = r < n ? dout[off] : 0.f;
            }
            __syncthreads();
#pragma unroll 4
            for (int r = 0; r < BT; ++r) {
                float s = 0.f, dp = 0.f;
#pragma unroll
                for (int t = 0; t < DL; ++t) {
                    int d = t * G + lane;
                    if (d < HEAD_DIM) { s += qs[r][d] * kr[t]; dp += dos[r][d] * vr[t]; }
                }
                s = group_sum(s) * scale;
                dp = group_sum(dp);
                float dcap = 1.f;
                if (softcap > 0.f) { float th = tanhf(s / softcap); s = softcap * th; dcap = 1.f - th * th; }
                bool ok = valid && r < n && ls[r] != NEG_INF && allowed(m, qp[r], pk, qd[r], dkd);
                float p = ok ? expf(s - ls[r]) : 0.f;
                float ds = p * (dp - dl[r]) * dcap * scale;
#pragma unroll
                for (int t = 0; t < DL; ++t) {
                    int d = t * G + lane;
                    if (d < HEAD_DIM) { dv[t] += p * dos[r][d]; dk[t] += ds * qs[r][d]; }
                }
            }
            __syncthreads();
        }
    }
    if (!valid) return;
#pragma unroll
    for (int t = 0; t < DL; ++t) {
        int d = t * G + lane;
        if (d < HEAD_DIM) { dk_out[koff + d] = dk[t]; dv_out[koff + d] = dv[t]; }
    }
}
