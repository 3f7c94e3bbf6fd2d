"""``--elastic``: membership rounds on a store that outlives the ranks (``membership``),
a peer's state by broadcast (``heal``), and what a strategy does with them (``replica``).
"""
