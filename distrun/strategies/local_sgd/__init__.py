"""DiLoCo's parts (strategies/diloco.py ties them together): what crosses the wire at a sync, the
global weights and their outer optimizer, the fragments streaming DiLoCo syncs one at a time, and
each replica's inner optimizer state gathered into a checkpoint."""
