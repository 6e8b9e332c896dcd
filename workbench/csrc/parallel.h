// parallel_run(fn, ctx, n): fn(ctx, t, nt) on nt <= n threads, t = 0 .. nt-1, the caller
// taking t = 0; returns once all have run. Shared by the kernels in this folder.
//
// Why OpenMP where it is built with -fopenmp (workbench/kernels.py does so when torch runs on
// libgomp): the kernel then runs on torch's own OpenMP threads, which spin for a while after
// each torch op. Threads of its own (the pthread path below) compete with those spinning
// threads for the two cores: a 48-row decode attention took 50 ms a step in a real decode
// (20 ms alone) on a Zen 4 with its own threads, against 20-27 ms on torch's.
#ifndef WORKBENCH_PARALLEL_H
#define WORKBENCH_PARALLEL_H

typedef void (*task_fn)(void *ctx, int t, int nt);

#ifdef _OPENMP
#include <omp.h>

static int parallel_run(task_fn fn, void *ctx, int n) {
    if (n < 1 || n > 64) return -1;
    if (n == 1) {
        fn(ctx, 0, 1);
        return 0;
    }
#pragma omp parallel num_threads(n)
    fn(ctx, omp_get_thread_num(), omp_get_num_threads());
    return 0;
}

#else
#include <pthread.h>

typedef struct {
    task_fn fn;
    void *ctx;
    int t, nt;
} parallel_task_t;

static void *parallel_task(void *arg) {
    parallel_task_t *p = arg;
    p->fn(p->ctx, p->t, p->nt);
    return 0;
}

static int parallel_run(task_fn fn, void *ctx, int n) {
    if (n < 1 || n > 64) return -1;
    parallel_task_t tasks[64];
    pthread_t th[64];
    for (int t = 0; t < n; t++) tasks[t] = (parallel_task_t){fn, ctx, t, n};
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
