// What flash-ring's two CUDA kernel sets share (flash_ring::cuda prepends it to flash.cu and to
// flash_mma.cu): the element type, the mask rule and the tile-level mask tests.
//
// Compile-time parameters (-D): ELEM_KIND (0 f32, 1 bf16, 2 f16). Every kernel runs NT = 128
// threads a block.
//
// The mask rule (the crate's, see spec.rs): a query at global position pq may attend a key at pk
// iff (!causal || pk <= pq) && (window < 0 || |pq - pk| < window) && (!docs || qdoc == kdoc).

#define NT 128
#define NEG_INF (__uint_as_float(0xff800000u))
#define LOG2E 1.4426950408889634f

#if ELEM_KIND == 0
typedef float elem_t;
__device__ __forceinline__ float load_elem(const elem_t* p) { return *p; }
#elif ELEM_KIND == 1
typedef unsigned short elem_t;
__device__ __forceinline__ float load_elem(const elem_t* p) {
    return __uint_as_float(((unsigned int)(*p)) << 16);
}
#else
typedef unsigned short elem_t;
__device__ __forceinline__ float load_elem(const elem_t* p) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
    return f;
}
#endif

struct MaskArgs {
    const int* q_pos;
    const int* k_pos;
    const int* q_doc;  // null when there are no documents
    const int* k_doc;
    int causal;
    int window;  // < 0: none
};

__device__ __forceinline__ bool allowed(const MaskArgs& m, int pq, int pk, int dq, int dk) {
    if (m.causal && pk > pq) return false;
    if (m.window >= 0 && abs(pq - pk) >= m.window) return false;
    if (m.q_doc != 0 && dq != dk) return false;
    return true;
}

// Ranges of positions and documents of a set of rows.
struct Span {
    int pmin, pmax, dmin, dmax;
};

// True when no (q, k) pair of the two spans can be allowed.
__device__ __forceinline__ bool disjoint(const MaskArgs& m, const Span& q, const Span& k) {
    if (m.causal && k.pmin > q.pmax) return true;
    if (m.window >= 0) {
        if (q.pmin - k.pmax >= m.window) return true;
        if (!m.causal && k.pmin - q.pmax >= m.window) return true;
    }
    if (m.q_doc != 0 && (q.dmax < k.dmin || k.dmax < q.dmin)) return true;
    return false;
}

// True when every (q, k) pair of the two spans is allowed (the tile needs no mask).
__device__ __forceinline__ bool covers(const MaskArgs& m, const Span& q, const Span& k) {
    if (m.causal && k.pmax > q.pmin) return false;
    if (m.window >= 0 && (q.pmax - k.pmin >= m.window || k.pmax - q.pmin >= m.window)) return false;
    if (m.q_doc != 0 && !(q.dmin == q.dmax && k.dmin == k.dmax && q.dmin == k.dmin)) return false;
    return true;
}

// The span of rows [r0, r0 + n) of pos/doc, reduced by the whole block (each thread loads at
// most a few rows, then warp shuffles) and shared through *out. Every thread of the block must
// call it; `scratch` is NT / 32 spans of shared memory.
__device__ void block_span(const int* pos, const int* doc, int r0, int n, Span* out,
                           Span* scratch) {
    Span s;
    s.pmin = 0x7fffffff; s.pmax = -0x7fffffff; s.dmin = 0x7fffffff; s.dmax = -0x7fffffff;
    for (int r = threadIdx.x; r < n; r += NT) {
        int p = pos[r0 + r];
        s.pmin = min(s.pmin, p); s.pmax = max(s.pmax, p);
        if (doc != 0) { int d = doc[r0 + r]; s.dmin = min(s.dmin, d); s.dmax = max(s.dmax, d); }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        s.pmin = min(s.pmin, __shfl_xor_sync(0xffffffffu, s.pmin, off));
        s.pmax = max(s.pmax, __shfl_xor_sync(0xffffffffu, s.pmax, off));
        s.dmin = min(s.dmin, __shfl_xor_sync(0xffffffffu, s.dmin, off));
        s.dmax = max(s.dmax, __shfl_xor_sync(0xffffffffu, s.dmax, off));
    }
    __syncthreads();  // the previous call's readers of *out are done
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        Span t = scratch[0];
        for (int w = 1; w < NT / 32; ++w) {
            t.pmin = min(t.pmin, scratch[w].pmin); t.pmax = max(t.pmax, scratch[w].pmax);
            t.dmin = min(t.dmin, scratch[w].dmin); t.dmax = max(t.dmax, scratch[w].dmax);
        }
        *out = t;
    }
    __syncthreads();
}
