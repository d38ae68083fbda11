"""What a page's status line says about its jobs' lives outside the job itself: a heavy
job's place in the server's queue, and a job the gallery's stop button stopped."""
from __future__ import annotations

__all__ = ["JobStatus"]


class JobStatus:
    """Status lines of `apps._view.View` for its runners (the ``status``, ``running`` and
    ``progress_active`` Parameters are the view's)."""

    def job_stopped(self, name: str) -> None:
        """The gallery's stop button stopped the job of runner ``name``: the status line says
        so instead of the job's last progress line, and the progress bar goes (pages that
        say more extend it)."""
        kept = getattr(self, "result", None) is not None
        self.param.update(running=False, progress_active=False,
                          status="Stopped before it finished"
                                 + (": the previous result is still shown." if kept else "."))

    def _queue_place(self, place: int) -> None:
        """Show a queued heavy job's place in line; put the page's own status back when it
        starts (``place`` 0)."""
        from apps._server import job_queue, place_text

        if place > 0:
            if not self.status.startswith("Waiting for the server:"):
                self._status_before_queue = self.status
            self.status = place_text(place, job_queue().running)
        elif self.status.startswith("Waiting for the server:"):
            self.status = getattr(self, "_status_before_queue", "")
