"""Pure policies (no torch, no zmq, no I/O): placement, assignment, alignment, failover, depth,
hybrid shares, strategies, the loader's copy passes and victims (loads), the hot set's eviction;
the runtime and the simulator decide with the same ones.
"""
