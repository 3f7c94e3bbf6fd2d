"""The data plan every strategy shares: one permutation per epoch, each global batch split
over the replicas (``plan``), and the input context recipes receive (``context``).
"""
