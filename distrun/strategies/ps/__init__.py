"""The parameter server's parts: which task holds what (``placement``), the model's shards
as both ends see them (``layout``), one worker's authenticated line to one task
(``channel``) and the task's side (``server``). The worker side is the strategy,
``strategies/parameter_server.py``.
"""
