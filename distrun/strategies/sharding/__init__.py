"""Sharded training with FSDP2 (``torch.distributed.fsdp.fully_shard``): which blocks are
sharded one by one (``units``), how the model is sharded and its optimizer rebuilt on the
shards (``apply``, after torchtitan's ``apply_fsdp``), and its state in the plain
checkpoint format that every other strategy reads (``state``).
"""
