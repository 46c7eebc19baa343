"""Tools around the runtime: tiny models, training (demo model, prerouter), calibration, emulation of
other hardware, and the Transformers reference.
"""
