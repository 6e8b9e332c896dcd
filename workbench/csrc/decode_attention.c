// Decode attention over a static KV cache: one new token per row, G query heads per kv head.
//
// Why: in batched regeneration a decode step reads the whole cache, and torch's CPU SDPA reads
// a bf16 cache at about 8 GB/s (fp32 at about 18) on the 2-core AMD machines, so attention
// took ~60% of a 48-row step at 680 slots. This kernel reads each key and value row once, in
// the cache's own layout, only over the row's own slots [lo, hi) (SDPA reads up to the
// longest row under a mask), two passes: scores and softmax in fp32, then the weighted sum.
// Built by workbench/decode_attention.py with the machine's C compiler, called through ctypes.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

// exp(x) for x <= 0 (a score minus the row's max), inline so the loop vectorises:
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
    const void *q, *k, *v;
    void *out;
    const int64_t *lo, *hi;
    int H, G, D;
    int64_t kb, kh, ks;  // cache strides in elements: row, kv head, slot (head_dim contiguous)
    float scale;
    int first, last;  // units (row, kv head) of this thread
    float *scores;    // [G, maxn] scratch
} job_t;

#define MAXG 8
#define MAXD 256

// One (row, kv head) unit per iteration; G and D are constants where the caller specialises.
#define BODY(NAME, LOAD, STORE)                                                               \
    static inline __attribute__((always_inline)) void NAME(job_t *j, const int G, const int D) { \
        float qf[MAXG * MAXD], acc[MAXG * MAXD], kf[MAXD], mx[MAXG], sum[MAXG];               \
        for (int u = j->first; u < j->last; u++) {                                            \
            const int b = u / j->H, h = u % j->H;                                             \
            const int64_t lo = j->lo[b], n = j->hi[b] - lo, qo = ((int64_t)b * j->H + h) * G * D; \
            for (int i = 0; i < G * D; i++) qf[i] = LOAD(j->q, qo + i) * j->scale;            \
            const int64_t base = b * j->kb + h * j->kh + lo * j->ks;                          \
            float *sc = j->scores;                                                            \
            for (int g = 0; g < G; g++) mx[g] = -INFINITY;                                    \
            for (int64_t s = 0; s < n; s++) {                                                 \
                for (int d = 0; d < D; d++) kf[d] = LOAD(j->k, base + s * j->ks + d);         \
                for (int g = 0; g < G; g++) {                                                 \
                    float a = 0.f;                                                            \
                    for (int d = 0; d < D; d++) a += qf[g * D + d] * kf[d];                   \
                    sc[g * n + s] = a;                                                        \
                    mx[g] = a > mx[g] ? a : mx[g];                                            \
                }                                                                             \
            }                                                                                 \
            for (int g = 0; g < G; g++) {                                                     \
                float t = 0.f;                                                                \
                for (int64_t s = 0; s < n; s++) {                                             \
                    float e = exp_le0(sc[g * n + s] - mx[g]);                                 \
                    sc[g * n + s] = e;                                                        \
                    t += e;                                                                   \
                }                                                                             \
                sum[g] = t;                                                                   \
            }                                                                                 \
            memset(acc, 0, sizeof(float) * G * D);                                            \
            for (int64_t s = 0; s < n; s++) {                                                 \
                for (int d = 0; d < D; d++) kf[d] = LOAD(j->v, base + s * j->ks + d);         \
                for (int g = 0; g < G; g++) {                                                 \
                    const float p = sc[g * n + s];                                            \
                    for (int d = 0; d < D; d++) acc[g * D + d] += p * kf[d];                  \
                }                                                                             \
            }                                                                                 \
            for (int g = 0; g < G; g++)                                                       \
                for (int d = 0; d < D; d++) STORE(j->out, qo + g * D + d, acc[g * D + d] / sum[g]); \
        }                                                                                     \
    }

BODY(body_bf16, load_bf16, store_bf16)
BODY(body_f32, load_f32, store_f32)

static void run_bf16(job_t *j) {
    if (j->G == 3 && j->D == 64) body_bf16(j, 3, 64);  // SmolLM2-135M: 9 heads on 3 kv heads
    else if (j->G == 4 && j->D == 64) body_bf16(j, 4, 64);
    else body_bf16(j, j->G, j->D);
}
static void run_f32(job_t *j) {
    if (j->G == 3 && j->D == 64) body_f32(j, 3, 64);
    else if (j->G == 4 && j->D == 64) body_f32(j, 4, 64);
    else body_f32(j, j->G, j->D);
}

typedef struct {
    job_t proto;
    int bf16;
    int64_t scratch_per_thread;
    float *scratch;
} split_t;

static void task(void *arg, int first, int last, int t) {  // units [first, last) on thread t
    split_t *s = arg;
    job_t j = s->proto;
    j.first = first;
    j.last = last;
    j.scores = s->scratch + (int64_t)t * s->scratch_per_thread;
    if (s->bf16) run_bf16(&j);
    else run_f32(&j);
}

// q, out: [B, H, G, D] contiguous; row b attends to slots [lo[b], hi[b]) of k and v, which hold
// T slots. bf16: 1 for bfloat16 data, 0 for float32. Returns 0, or a negative code: -1 bad
// sizes, -2 out of memory, -3 a slot range outside [0, T) or empty.
int decode_attention(int bf16, const void *q, const void *k, const void *v, void *out,
                     const int64_t *lo, const int64_t *hi, int B, int H, int G, int D, int64_t T,
                     int64_t kb, int64_t kh, int64_t ks, float scale, int nthreads) {
    if (G < 1 || G > MAXG || D < 1 || D > MAXD || B < 1 || H < 1 || nthreads < 1 || nthreads > 64)
        return -1;
    int64_t maxn = 1;
    for (int b = 0; b < B; b++) {
        if (lo[b] < 0 || hi[b] <= lo[b] || hi[b] > T) return -3;  // a row sees its own token
        if (hi[b] - lo[b] > maxn) maxn = hi[b] - lo[b];
    }
    const int units = B * H;
    if (nthreads > units) nthreads = units;  // as parallel_for does: scratch for that many
    float *scratch = malloc(sizeof(float) * (size_t)G * (size_t)maxn * (size_t)nthreads);
    if (!scratch) return -2;
    split_t s = {{q, k, v, out, lo, hi, H, G, D, kb, kh, ks, scale, 0, 0, 0}, bf16,
                 (int64_t)G * maxn, scratch};
    int rc = parallel_for(task, &s, units, nthreads);
    free(scratch);
    return rc;
}
