"""What runs the platform on a real host: units, proxy and Redis configs, the hash locks, the production check."""
