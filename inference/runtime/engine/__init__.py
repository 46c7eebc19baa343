"""Main's engine: one thread, one explicit step loop.

``scheduler`` decides each step (pure), ``runner`` runs it over the batch layer by layer,
``exchange`` serves a layer's experts with the workers, ``guesses`` holds main's own
per-layer predictions and routing changes (prerouter, next-gate, importance), ``sampling``
picks each sequence's next token, ``sequence`` is what the engine keeps of each, and
``engine`` is the loop that calls them in turn.
"""
