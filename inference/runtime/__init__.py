"""The runtime: the roles (main, shadow, workers), the engine, transport and its keys, settings files
(spec), stores, loading and staging, the client and the local launcher, metrics.
"""
