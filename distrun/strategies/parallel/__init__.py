"""Model parallelism: splitting one replica over several ranks (``--tp``), and activation
checkpointing. Each concern is a module; ``strategies/model_parallel.py`` composes them."""
