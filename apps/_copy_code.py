"""A "Copy … as code" button: one click writes the snippet to the clipboard and opens it in a
dialog over the page, wide enough to read (monospace, long lines wrapped, scrolling down).

The gallery sidebar has two: the workspace's (`explorer.workspace.Workspace.copy_as_code`) and
the page's (`apps.gallery.Gallery.page_code`). The snippet is kept in the browser as it changes,
so the click copies it at once, inside the click, as browsers require of the clipboard. Where
the browser refuses the clipboard (no permission, a page served over plain http off localhost)
the dialog's text is selected instead, and the dialog says to press Ctrl+C.
"""
from __future__ import annotations

from typing import Any

import panel as pn
import param

__all__ = ["CopyCode"]


_CSS = """
:host { display: block; }
.copy-code-open {
  width: 100%; min-height: 32px; padding: 4px 10px; cursor: pointer;
  font: inherit; font-size: 0.95em; border-radius: 4px;
  border: 1px solid #c8c8c8; background: #f4f4f4; color: #222;
}
.copy-code-open:hover { background: #e8e8e8; }
.copy-code-open:focus-visible, .copy-code-dialog button:focus-visible {
  outline: 2px solid var(--accent-fill-rest, #1f77b4); outline-offset: 1px; }
.copy-code-dialog {
  width: min(960px, calc(100vw - 48px)); max-height: calc(100vh - 64px);
  padding: 0; border: 1px solid #bbb; border-radius: 6px;
  box-shadow: 0 8px 32px rgba(0, 0, 0, 0.3); color: #222; background: white;
}
.copy-code-dialog[open] { display: flex; flex-direction: column; }
.copy-code-dialog::backdrop { background: rgba(0, 0, 0, 0.35); }
.copy-code-head {
  display: flex; align-items: center; gap: 8px; padding: 8px 12px;
  border-bottom: 1px solid #ddd; font-family: system-ui, sans-serif;
}
.copy-code-title { font-weight: 600; flex: 1 1 auto; }
.copy-code-note { color: #555; font-size: 0.9em; }
.copy-code-dialog button.copy-code-copy, .copy-code-dialog button.copy-code-close {
  padding: 4px 12px; cursor: pointer; border-radius: 4px; font: inherit; font-size: 0.9em;
  border: 1px solid #c8c8c8; background: #f4f4f4; color: #222;
}
.copy-code-dialog button.copy-code-copy {
  background: var(--accent-fill-rest, #1f77b4); border-color: transparent; color: white; }
.copy-code-text {
  margin: 0; padding: 12px 16px; overflow-y: auto; overflow-x: hidden; flex: 1 1 auto;
  font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace;
  font-size: 13px; line-height: 1.45; white-space: pre-wrap; overflow-wrap: anywhere;
  background: #fafafa; user-select: text;
}
"""


class CopyCode(pn.custom.ReactiveHTML):
    """A button that copies `code` to the clipboard and shows it in a dialog.

    The button's box carries ``data-copied`` after a click, for tests: ``"clipboard"`` when the
    clipboard took the text, ``"selected"`` when the browser refused it and the text was
    selected for Ctrl+C instead.
    """

    code = param.String(default="", doc="The snippet copied and shown.")
    label = param.String(default="Copy as code", doc="The button's text.")
    title = param.String(default="Python", doc="The dialog's title.")
    clicks = param.Integer(default=0, doc="How many times the button was clicked.")

    _template = """
<div id="box" class="copy-code" data-copied="">
  <button id="opener" class="copy-code-open" type="button" onclick="${script('show')}"></button>
  <dialog id="dialog" class="copy-code-dialog">
    <div id="head" class="copy-code-head">
      <span id="heading" class="copy-code-title"></span>
      <span id="note" class="copy-code-note" aria-live="polite"></span>
      <button id="copier" class="copy-code-copy" type="button" onclick="${script('copy_again')}">Copy</button>
      <button id="closer" class="copy-code-close" type="button" onclick="${script('hide')}">Close</button>
    </div>
    <pre id="codetext" class="copy-code-text" tabindex="0"></pre>
  </dialog>
</div>
"""

    _scripts = {
        "render": """
          opener.textContent = data.label
          opener.title = data.label + ': copy the Python to the clipboard and show it'
          heading.textContent = data.title
          codetext.textContent = data.code
          dialog.addEventListener('click', (e) => { if (e.target === dialog) dialog.close() })
          state.selectAll = () => {
            const range = document.createRange()
            range.selectNodeContents(codetext)
            const sel = window.getSelection()
            sel.removeAllRanges()
            sel.addRange(range)
          }
          state.refused = () => {
            state.selectAll()
            let copied = false
            try { copied = document.execCommand('copy') } catch (e) { copied = false }
            box.dataset.copied = copied ? 'clipboard' : 'selected'
            note.textContent = copied ? 'Copied to the clipboard.'
              : 'The browser refused the clipboard: the code is selected, press Ctrl+C (⌘C).'
          }
          state.write = () => {
            const code = data.code
            codetext.textContent = code
            note.textContent = ''
            box.dataset.copied = ''
            const clip = navigator.clipboard
            if (!clip || !window.isSecureContext || !clip.writeText) { state.refused(); return }
            clip.writeText(code).then(() => {
              box.dataset.copied = 'clipboard'
              note.textContent = 'Copied to the clipboard.'
            }, () => state.refused())
          }
        """,
        "code": "codetext.textContent = data.code",
        "label": "opener.textContent = data.label",
        "title": "heading.textContent = data.title",
        "show": """
          if (!dialog.open) dialog.showModal()
          state.write()
          data.clicks = data.clicks + 1
        """,
        "copy_again": "state.write()",
        "hide": "dialog.close()",
    }

    _stylesheets = [_CSS]

    def __init__(self, **params: Any):
        params.setdefault("margin", (5, 10))
        params.setdefault("sizing_mode", "stretch_width")
        super().__init__(**params)
