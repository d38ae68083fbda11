"""The gallery's address bar and links: the browser's address follows the view (the page,
the prompt, the selection, the edits and the page's settings), *Back* and *Forward* reopen
what was there, and a link opened in a new session is followed (`LinksPart.open_link`)."""
from __future__ import annotations

from typing import Any

import panel as pn
import param
from panel.custom import JSComponent

from apps import theme
from apps._session import served_document
from explorer._checks import ExplorerError
from explorer.workspace import Workspace, read_link, workspace_link

__all__ = ["AddressBar", "LinksPart"]


class AddressBar(JSComponent):
    """The browser's address bar kept equal to the view, in the browser itself.

    A click on the navigation (a button of the ``gallery-nav`` group) or on a page link
    (``<a data-view="slug">``, the home page's) writes ``?view=<slug>`` at once, before the
    server answers, so the address follows the page however busy the server is. The server
    then sets `query` (the whole link: page and ``s=`` state), which replaces the address, or
    pushes a new entry when the server itself changed the page. Back / Forward (and page
    links) send the address to the server as `popped`, which opens its page.
    """

    query = param.String(default="", doc="The link of the view shown (server -> browser).")
    popped = param.String(default="", doc="The address after Back / Forward or a page link "
                                          "(browser -> server), with a counter.")
    titles = param.Dict(default={}, doc="Navigation title -> page slug.")

    _esm = """
export function render({ model }) {
  const slugOf = (search) => new URLSearchParams(search).get('view')
  const pop = () => { model.popped = window.location.search + '#' + Date.now() + Math.random() }
  const go = (slug) => {
    if (slug == null || slugOf(window.location.search) === slug) return
    window.__explorerNav = slug
    history.pushState(null, '', '?view=' + encodeURIComponent(slug))
  }
  const sync = () => {
    const want = model.query
    if (!want || window.location.search === want) return
    const next = slugOf(want)
    const pending = window.__explorerNav
    if (pending != null) {
      if (next !== pending) return          // an answer from before the user's last click
      window.__explorerNav = null
    }
    if (slugOf(window.location.search) === next) history.replaceState(null, '', want)
    else history.pushState(null, '', want)
  }
  const onclick = (e) => {
    if (e.button !== 0 || e.ctrlKey || e.metaKey || e.shiftKey || e.altKey) return
    const path = e.composedPath()
    const link = path.find(el => el.tagName === 'A' && el.dataset && el.dataset.view)
    if (link) {
      e.preventDefault()
      go(link.dataset.view)
      pop()
      return
    }
    const button = path.find(el => el.tagName === 'BUTTON')
    const nav = path.find(el => el.classList && el.classList.contains('gallery-nav'))
    if (button && nav) go(model.titles[button.textContent.trim()])
  }
  const onpop = () => { window.__explorerNav = slugOf(window.location.search); pop() }
  document.addEventListener('click', onclick, true)
  window.addEventListener('popstate', onpop)
  model.on('query', sync)
  model.on('remove', () => {
    document.removeEventListener('click', onclick, true)
    window.removeEventListener('popstate', onpop)
  })
  sync()
  const el = document.createElement('span')
  el.className = 'address-bar'
  return el
}
"""


class LinksPart:
    """The links of `apps.gallery.Gallery`: the address bar, opening a link, Copy link."""

    def page_settings(self, slug: str) -> dict[str, Any]:
        """The settings of page ``slug`` a link and the export carry: its ``link_params``
        (empty for a page not built yet or without any)."""
        view = self._pages.get(slug)
        out: dict[str, Any] = {}
        for name in getattr(view, "link_params", ()) or ():
            if name in view.param:
                value = getattr(view, name)
                out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def _apply_settings(self, slug: str, view: Any, settings: dict[str, Any]) -> list[str]:
        """Set ``settings`` on the page; a name it does not carry or a value it refuses is
        left as it is, and said (returned and shown under the link message). A setting that
        moves the page's own pick (the Attention page's enlarged head) selects nothing in the
        workspace: the link or state carries the selection itself."""
        allowed = set(getattr(view, "link_params", ()) or ())
        problems = []
        pushing, self._pushing_selection = getattr(self, "_pushing_selection", False), True
        try:
            for name, value in settings.items():
                if name not in allowed or name not in view.param:
                    problems.append(f"{self.titles.get(slug, slug)} has no setting {name!r} that "
                                    f"links carry (it carries "
                                    f"{', '.join(sorted(allowed)) or 'none'})")
                    continue
                try:
                    setattr(view, name, value)
                except (ValueError, TypeError, ExplorerError) as exc:
                    problems.append(f"{self.titles.get(slug, slug)}: {name} = {value!r} "
                                    f"refused: {exc}")
        finally:
            self._pushing_selection = pushing
        if problems:
            self._link_problem("; ".join(problems))
        return problems

    def link(self) -> tuple[str, int]:
        """The query string of a link to what this session shows (``?view=<slug>&s=<state>``,
        `explorer.workspace.workspace_link`), and how many edits it leaves out."""
        ws = self.workspace
        settings = self.page_settings(self.view)
        opening = Workspace.param["prompts"].default      # the sidebar's prompt on opening
        plain = (ws.prompts == opening and not ws.second_prompt and not ws.selection
                 and not ws.edits and not settings)
        if plain:
            return f"?view={self.view}", 0
        state, left_out = workspace_link(ws, view=self.view, settings=settings)
        return f"?view={self.view}&s={state}", left_out

    def _update_address(self, *_: Any) -> None:
        try:
            query, _ = self.link()
        except ExplorerError as exc:  # a setting a link cannot hold: the page alone
            query = f"?view={self.view}"
            self.link_note = f"The link holds the page only: {exc}"
        if self._address.query != query:
            self._address.query = query

    def _address_popped(self, event: Any) -> None:
        """Back / Forward or a page link: open the page the address names."""
        search = (event.new or "").split("#", 1)[0]
        from urllib.parse import parse_qs

        slug = (parse_qs(search.lstrip("?")).get("view") or [None])[0]
        if slug is None:
            slug = next(iter(self._specs))
        if slug in self._specs:
            if self.view != slug:
                self.view = slug
            else:
                self._update_address()
        else:
            self._link_problem(f"there is no page {slug!r}; the pages are "
                               f"{', '.join(self._specs)}")

    def _link_problem(self, text: str) -> None:
        message = f"This link could not be opened as it was: {text}."
        self.link_message = message if not self.link_message else f"{self.link_message} {text}."
        if served_document() is not None and not pn.state.loaded:  # still opening: once it shows
            pn.state.onload(lambda: theme.notify("error", message, duration=10000))
        else:
            theme.notify("error", message, duration=10000)
        if self.view is not None:
            self._show_page()

    def open_link(self, view: str | None = None, state: str | None = None) -> bool:
        """Open what a link holds: the page ``view`` and the ``state`` text
        (`explorer.workspace.read_link`: prompt, selection, edits, the page's settings). A
        link that cannot be read or does not fit this app's model opens the page alone (or
        the first page) with a message saying why; returns whether all of it was followed."""
        ok = True
        if state:
            try:
                link = read_link(state, model=self._model)
                self._check_prompt(link.workspace.prompt)
                self._check_second_prompt(link.workspace.second_prompt)
            except ExplorerError as exc:
                self._link_problem(str(exc).rstrip("."))
                ok = False
            else:
                if view is not None and link.view is not None and link.view != view:
                    self._link_problem(f"its page is {view!r} but its state was written on "
                                       f"{link.view!r}")
                    ok = False
                view = view or link.view
                self.workspace.update_from(link.workspace)
                if link.settings and view in self._specs:
                    if view in self._pages:
                        ok = not self._apply_settings(view, self._pages[view], link.settings) and ok
                    else:
                        self._pending_settings[view] = dict(link.settings)
        if view is not None:
            if view in self._specs:
                self.view = view
            else:
                self._link_problem(f"there is no page {view!r}; the pages are "
                                   f"{', '.join(self._specs)}")
                ok = False
        self._update_address()
        return ok

    def _open_session_link(self) -> None:
        """The link this browser session was opened with (its query arguments)."""
        args = getattr(pn.state, "session_args", None) or {}

        def arg(name: str) -> str | None:
            values = args.get(name)
            if not values:
                return None
            value = values[0]
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)

        view, state = arg("view"), arg("s")
        if view is not None or state is not None:
            self.open_link(view, state)

    def _link_copied(self, *_: Any) -> None:
        query, left_out = self.link()
        text = f"Link copied ({len(query):,} characters)."
        if left_out:
            text += (f" {left_out} edit(s) holding a vector are not in it: Export state keeps "
                     "them.")
        self.link_note = text
