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

// The span of rows [r0, r0 + n) (r0 a multiple of 16) from the host's spans of 16-row chunks:
// spans[c] = (pmin, pmax, dmin, dmax) of rows 16 c .. 16 c + 15 (documents 0 without them).
// Every thread reads the same few entries, so no barrier is needed.
__device__ __forceinline__ Span tile_span(const int4* spans, int r0, int n) {
    const int4 a = spans[r0 / 16];
    Span s;
    s.pmin = a.x; s.pmax = a.y; s.dmin = a.z; s.dmax = a.w;
    for (int c = r0 / 16 + 1; c <= (r0 + n - 1) / 16; ++c) {
        const int4 b = spans[c];
        s.pmin = min(s.pmin, b.x); s.pmax = max(s.pmax, b.y);
        s.dmin = min(s.dmin, b.z); s.dmax = max(s.dmax, b.w);
    }
    return s;
}
