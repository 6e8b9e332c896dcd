"""Experiments: resumable sweeps (sweep), the step-count cost model (steps), the local engine
backend (local), the all-reduce microbenchmark and TP-scaling model (allreduce), and the
NCCL/SGLang communication settings matrix (nccl)."""
