"""Thin adapters to engines that own the processes (Ray Train); each imports its engine lazily.

    from tfdist.integrations import ray as tfdist_ray   # needs `pip install tfdist[ray]`
"""
