"""What a generation asks for, declared once.

The runtime's ``GenerateRequest`` (client to main), the agent link's ``Generate`` (control
plane to main's agent) and the control plane's ``GenerationRequest`` all carry exactly these
fields, by inheriting them: a new sampling option is added here and reaches every hop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GenerationFields:
    prompt_ids: list[int]
    max_new_tokens: int
    do_sample: bool = False  # greedy unless set
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # Who asked (an opaque id, e.g. the control plane's user id): main shares its batch fairly
    # between users, so one user's many requests do not keep another's waiting.
    user: str = ""

    def generation_fields(self) -> dict:
        """These fields of ``self`` by name, to hand them on to the next hop's message."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerationFields)}
