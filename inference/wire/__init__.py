"""Every message that crosses a process, declared once and torch-free.

Three modules, one vocabulary:

- ``generation``: what a generation asks for (``Generate``) and what it reports
  (``Token | Done | Failed``). These cross every hop unchanged: the control plane sends a
  ``Generate`` down the agent link, the agent hands it to main over ZeroMQ, and main's events
  come back up the same way to the control plane's SSE and websocket adapters.
- ``runtime``: what the runtime's processes say to each other over ZeroMQ. Tensor fields are
  declared with the ``Tensor`` marker; their bytes travel as raw frames, framed by
  ``inference.runtime.protocol`` (the one module here that needs torch).
- ``link``: the agent link's commands and events (JSON over a websocket).

Every message is a frozen, keyword-only ``msgspec.Struct`` whose type is a tag: the agent
link writes it as ``"type"``, the ZeroMQ header as ``"t"`` (``TYPE``). Both tags are what they
were before the vocabulary was merged, so a frame keeps its meaning. Arriving messages are
validated by msgspec's strict typed decoding, never by hand.

Importing this package never imports torch (``tests/inference/wire/test_wire.py`` checks it), so the
control plane's web and Celery processes can import any message.
"""
