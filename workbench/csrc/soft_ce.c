// Soft cross-entropy of draft logits z against the target distribution softmax(t), per row:
//   ce = logsumexp(z) - sum softmax(t) * z,   argmax(z),   d ce / d z = softmax(z) - softmax(t).
//
// Why: the TTT loss scores every draft position against the target's distribution over the
// draft vocab (4096-32768 columns), about 8K rows a step of the quick preset. torch does it in
// about ten passes over [rows, V] tensors (the upcast, the target softmax written out, the
// logsumexp, the product, its sum, the argmax; the backward's softmax, subtraction and scaling),
// plus a gather of the target rows. Here a row of z and its target row are read twice forward
// (both stay in L1/L2) and once backward, the target read in place through a row index, and only
// the two log-normalisers per row are kept between forward and backward.
// Built by workbench/kernels.py with the machine's C compiler, called through ctypes by
// workbench/draft/soft_ce.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "parallel.h"

static inline float load_bf16(const void *p, int64_t i) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((const uint16_t *)p)[i] << 16;
    return c.f;
}
static inline float load_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline void store_bf16(void *p, int64_t i, float f) {  // round to nearest even
    union { uint32_t u; float f; } c;
    c.f = f;
    uint16_t r = (c.u & 0x7fffffff) > 0x7f800000 ? 0x7fc0 : (uint16_t)((c.u + 0x7fff + ((c.u >> 16) & 1)) >> 16);
    ((uint16_t *)p)[i] = r;
}
static inline void store_f32(void *p, int64_t i, float f) { ((float *)p)[i] = f; }

// exp(x) for x <= ~0 (a logit minus the row's max or log-normaliser), inline so loops vectorise:
// 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor p (rel. error < 2e-7).
static inline float exp_le0(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_roundf(x * 1.44269504088896341f);
    float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * c.f;
}

typedef struct {
    const void *z, *t;
    int64_t zs, ts;        // row strides in elements (columns contiguous)
    const int64_t *rows;   // target row of each z row
    float *ce, *lz, *lt;   // forward: per-row loss and log-normalisers (saved for backward)
    int64_t *top;          // forward: argmax(z), or NULL
    const float *g;        // backward: upstream gradient per row
    void *gz;              // backward: [N, V] contiguous, z's dtype
    int V, first, last;
} job_t;

#define FWD(NAME, ZL, TL)                                                                     \
    static void NAME(job_t *j) {                                                              \
        const int V = j->V;                                                                   \
        for (int r = j->first; r < j->last; r++) {                                            \
            const int64_t zo = r * j->zs, to = j->rows[r] * j->ts;                            \
            float mz = -INFINITY, mt = -INFINITY;                                             \
            for (int v = 0; v < V; v++) {                                                     \
                const float a = ZL(j->z, zo + v), b = TL(j->t, to + v);                       \
                mz = a > mz ? a : mz;                                                         \
                mt = b > mt ? b : mt;                                                         \
            }                                                                                 \
            float sz = 0.f, st = 0.f, d = 0.f;                                                \
            for (int v = 0; v < V; v++) {                                                     \
                const float a = ZL(j->z, zo + v), e = exp_le0(TL(j->t, to + v) - mt);         \
                sz += exp_le0(a - mz);                                                        \
                st += e;                                                                      \
                d += e * a;                                                                   \
            }                                                                                 \
            const float lz = mz + logf(sz);                                                   \
            j->lz[r] = lz;                                                                    \
            j->lt[r] = mt + logf(st);                                                         \
            j->ce[r] = lz - d / st;                                                           \
            if (j->top) {                                                                     \
                int64_t k = 0;                                                                \
                while (k < V - 1 && !(ZL(j->z, zo + k) == mz)) k++;                           \
                j->top[r] = k;                                                                \
            }                                                                                 \
        }                                                                                     \
    }

#define BWD(NAME, ZL, TL, GS)                                                                 \
    static void NAME(job_t *j) {                                                              \
        const int V = j->V;                                                                   \
        for (int r = j->first; r < j->last; r++) {                                            \
            const int64_t zo = r * j->zs, to = j->rows[r] * j->ts, go = (int64_t)r * V;       \
            const float lz = j->lz[r], lt = j->lt[r], g = j->g[r];                            \
            for (int v = 0; v < V; v++)                                                       \
                GS(j->gz, go + v, (exp_le0(ZL(j->z, zo + v) - lz) - exp_le0(TL(j->t, to + v) - lt)) * g); \
        }                                                                                     \
    }

FWD(fwd_bb, load_bf16, load_bf16)
FWD(fwd_bf, load_bf16, load_f32)
FWD(fwd_fb, load_f32, load_bf16)
FWD(fwd_ff, load_f32, load_f32)
BWD(bwd_bb, load_bf16, load_bf16, store_bf16)
BWD(bwd_bf, load_bf16, load_f32, store_bf16)
BWD(bwd_fb, load_f32, load_bf16, store_f32)
BWD(bwd_ff, load_f32, load_f32, store_f32)

typedef void (*body_t)(job_t *);
typedef struct {
    body_t body;
    job_t proto;
} split_t;

static void task(void *arg, int first, int last, int t) {  // rows [first, last)
    (void)t;
    split_t *s = arg;
    job_t j = s->proto;
    j.first = first;
    j.last = last;
    s->body(&j);
}

// Rows split evenly over nthreads (`parallel.h`).
static int split(body_t body, job_t proto, int N, int nthreads) {
    split_t s = {body, proto};
    return parallel_for(task, &s, N, nthreads);
}

// z [N, V] (row stride zs), t [*, V] (row stride ts), row r scored against t[rows[r]].
// zbf16 / tbf16: 1 for bfloat16, 0 for float32. top may be NULL. Returns 0, or < 0 on bad args.
int soft_ce_forward(int zbf16, int tbf16, const void *z, int64_t zs, const void *t, int64_t ts,
                    const int64_t *rows, int N, int V, float *ce, int64_t *top, float *lz,
                    float *lt, int nthreads) {
    if (N < 0 || V < 1) return -2;
    static const body_t bodies[4] = {fwd_ff, fwd_fb, fwd_bf, fwd_bb};
    job_t j = {z, t, zs, ts, rows, ce, lz, lt, top, NULL, NULL, V, 0, 0};
    return split(bodies[(zbf16 ? 2 : 0) + (tbf16 ? 1 : 0)], j, N, nthreads);
}

// gz [N, V] contiguous in z's dtype = (exp(z - lz) - exp(t[rows] - lt)) * g, per row.
int soft_ce_backward(int zbf16, int tbf16, const void *z, int64_t zs, const void *t, int64_t ts,
                     const int64_t *rows, int N, int V, const float *lz, const float *lt,
                     const float *g, void *gz, int nthreads) {
    if (N < 0 || V < 1) return -2;
    static const body_t bodies[4] = {bwd_ff, bwd_fb, bwd_bf, bwd_bb};
    job_t j = {z, t, zs, ts, rows, NULL, (float *)lz, (float *)lt, NULL, g, gz, V, 0, 0};
    return split(bodies[(zbf16 ? 2 : 0) + (tbf16 ? 1 : 0)], j, N, nthreads);
}
