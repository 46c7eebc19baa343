"""Stop sequences for streamed text: hand out only text that cannot turn into a stop sequence.

Pure: ``StopScanner.feed`` takes each new piece of text and returns what is safe to show;
once a stop sequence appears, the text before it is all that is ever shown.
"""

from __future__ import annotations


class StopScanner:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # a tail that may begin a stop
        self.text = ""
        self.shown = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        self.text += delta
        found = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            return self._show(min(found))
        return self._show(max(self.shown, len(self.text) - self.hold))

    def finish(self) -> str:
        """The held-back tail, at the end of a generation that did not stop on a sequence."""
        return "" if self.stopped else self._show(len(self.text))

    def _show(self, upto: int) -> str:
        piece, self.shown = self.text[self.shown : upto], upto
        return piece

    @property
    def visible(self) -> str:
        return self.text[: self.shown]
