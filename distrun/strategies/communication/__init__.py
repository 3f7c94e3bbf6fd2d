"""Gradient communication: compression hooks (fp16, bf16, PowerSGD), the hierarchical
all-reduce, the bucket queue they share, and ``--allreduce auto``'s rules and probe.
"""
