"""The Knowledge conflicts page's own examples (`apps.conflicts`'s part; no other page imports
it): the "Your own example" box's Use adds a pasted example to the examples and shows it, and
`own_examples` holds the texts taken in, so a link carries them; a page given them (a link)
adds them to its examples, and the link's example picks the one shown."""
from __future__ import annotations

from typing import Any

import param

from apps._conflicts_plots import _label
from explorer.analyses import conflicts as C
from explorer.analyses import user_items

__all__ = ["OwnExamplesPart"]


class OwnExamplesPart(param.Parameterized):
    """The user's own examples of `apps.conflicts.ConflictsView` (its ``_own`` box follows
    `own_examples`)."""

    own_examples = param.List(default=[], item_type=str, precedence=-1,
                              doc="Your own examples (the texts Use took in, in order); a link "
                                  "carries them, and a page given them adds them to the examples "
                                  "(the link's example then picks one)")

    def _add_own(self, fact: C.Fact) -> str:
        """Add the user's example to the examples; its label."""
        label = _label(fact) if fact.relation == "yours" else "yours: " + _label(fact)
        self._facts[label] = fact
        self.param.example.objects = list(self._facts)
        return label

    def use_own(self, text: str) -> C.Fact | None:
        """Parse the user's example, add it to the examples and show it (the same job as a
        shipped one); bad text shows the parser's message and keeps the current result."""
        def use(fact: C.Fact) -> None:
            label = self._add_own(fact)
            if text not in self.own_examples:
                self._own.keep([*self.own_examples, text])
            if self.example == label:
                self._request("example")
            else:
                self.example = label
        return self.adopt_own(text, user_items.parse_conflict_example, use)

    def _own_examples_set(self, event: Any) -> None:
        """Examples set from elsewhere (a link): each new one is added to the examples (the
        link's example picks the one shown) and the box shows the last; one refused (the
        parser's message shows) is left out, and those taken in before stay."""
        taken = list(event.old)
        for text in event.new:
            if text in taken:
                continue
            if self.adopt_own(text, user_items.parse_conflict_example, self._add_own) is not None:
                taken.append(text)
                self._own.area.value = text
        if taken != list(event.new):
            self._own.keep(taken)
