"""The three runtime roles, one module each: main, shadow and worker."""
