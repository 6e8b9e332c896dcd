// parallel_for(fn, ctx, units, n): units [0, units) split evenly over nt = min(n, units) threads
// (at least 1), fn(ctx, first, last, t) on thread t = 0 .. nt-1, the caller taking t = 0;
// returns 0 once all have run, -1 for n outside 1..64. Shared by the kernels in this folder.
//
// Why OpenMP where it is built with -fopenmp (workbench/kernels.py does so when torch runs on
// libgomp): the kernel then runs on torch's own OpenMP threads, which spin for a while after
// each torch op. Threads of its own (the pthread path below) compete with those spinning
// threads for the two cores: a 48-row decode attention took 50 ms a step in a real decode
// (20 ms alone) on a Zen 4 with its own threads, against 20-27 ms on torch's.
#ifndef WORKBENCH_PARALLEL_H
#define WORKBENCH_PARALLEL_H

#include <stdint.h>

typedef void (*range_fn)(void *ctx, int first, int last, int t);

static inline void parallel_share(range_fn fn, void *ctx, int units, int t, int nt) {
    fn(ctx, (int)((int64_t)units * t / nt), (int)((int64_t)units * (t + 1) / nt), t);
}

#ifdef _OPENMP
#include <omp.h>

static int parallel_for(range_fn fn, void *ctx, int units, int n) {
    if (n < 1 || n > 64) return -1;
    if (n > units) n = units > 0 ? units : 1;
    if (n == 1) {
        fn(ctx, 0, units, 0);
        return 0;
    }
#pragma omp parallel num_threads(n)
    parallel_share(fn, ctx, units, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

#else
#include <pthread.h>

typedef struct {
    range_fn fn;
    void *ctx;
    int units, t, nt;
} parallel_task_t;

static void *parallel_task(void *arg) {
    parallel_task_t *p = arg;
    parallel_share(p->fn, p->ctx, p->units, p->t, p->nt);
    return 0;
}

static int parallel_for(range_fn fn, void *ctx, int units, int n) {
    if (n < 1 || n > 64) return -1;
    if (n > units) n = units > 0 ? units : 1;
    parallel_task_t tasks[64];
    pthread_t th[64];
    for (int t = 0; t < n; t++) tasks[t] = (parallel_task_t){fn, ctx, units, t, n};
    int started = 1;
    for (int t = 1; t < n; t++) {
        if (pthread_create(&th[t], 0, parallel_task, &tasks[t]) != 0) break;  // the rest run here
        started++;
    }
    parallel_task(&tasks[0]);
    for (int t = started; t < n; t++) parallel_task(&tasks[t]);
    for (int t = 1; t < started; t++) pthread_join(th[t], 0);
    return 0;
}
#endif

#endif
