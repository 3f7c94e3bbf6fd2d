"""A replica's step settings, applied by every strategy's ``prepare``: ``settings`` (the
step), ``precision`` (autocast and the agreed fp16 loss scaler), ``compile`` (torch.compile
in DDP's order).
"""
