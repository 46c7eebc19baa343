"""Tools around the runtime: tiny models, training (demo model, prerouter), calibration, emulation of
other hardware, the Transformers reference, and main's engine in one process (``local_engine``),
which also drives the simulator (``engine_passes``).
"""
