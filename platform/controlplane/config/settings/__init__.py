"""Settings split by purpose: base (shared), local (a laptop), test, production."""
