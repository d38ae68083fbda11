"""`apps._preview_slot.PreviewSlot`: one preview at a time, the newest move waiting, older
moves dropped, a cancel from outside freeing the path."""
from __future__ import annotations

from apps._preview_slot import PreviewSlot
from apps._session import CancelToken


def _slot(closed: bool = False):
    started: list[tuple] = []
    tokens: list[CancelToken] = []

    def submit(request, lane):
        if closed:
            return None
        started.append((request, lane))
        tokens.append(CancelToken())
        return tokens[-1]
    return PreviewSlot(submit), started, tokens


def test_moves_while_busy_keep_only_the_newest():
    slot, started, _ = _slot()
    slot.request(1)
    for move in (2, 3, 4):
        slot.request(move)
    assert started == [(1, "preview")] and slot.busy and slot.pending == 4
    slot.landed()
    slot.next()
    assert started == [(1, "preview"), (4, "preview")] and slot.pending is None and slot.busy
    slot.landed()
    slot.next()
    assert not slot.busy and len(started) == 2
    slot.request(5)                                  # idle again: starts at once
    assert started[-1] == (5, "preview")


def test_a_warm_up_starts_only_when_idle():
    slot, started, _ = _slot()
    assert slot.warm("w") and started == [("w", "warm")]
    assert not slot.warm("again") and len(started) == 1
    slot.request("move")                              # waits behind the warm-up
    assert slot.pending == "move"
    slot.landed()
    slot.next()
    assert started[-1] == ("move", "preview")


def test_a_cancel_from_outside_frees_the_path_and_drops_the_waiting_move():
    slot, started, tokens = _slot()
    slot.request(1)
    slot.request(2)
    tokens[0].cancel()
    assert not slot.busy and slot.pending is None
    slot.request(3)
    assert started[-1] == (3, "preview")


def test_a_landed_preview_is_not_freed_by_a_later_cancel_of_its_token():
    slot, started, tokens = _slot()
    slot.request(1)
    slot.landed()
    slot.request(2)                                   # waits: the first is still drawing
    tokens[0].cancel()
    assert slot.busy and slot.pending == 2


def test_an_exact_run_drops_the_waiting_move_and_reset_idles_the_path():
    slot, started, _ = _slot()
    slot.request(1)
    slot.request(2)
    slot.drop_pending()
    assert slot.pending is None and slot.busy
    slot.reset()
    assert not slot.busy
    slot.request(3)
    assert started[-1] == (3, "preview")


def test_a_closed_page_leaves_the_path_idle():
    slot, started, _ = _slot(closed=True)
    slot.request(1)
    assert not slot.busy and slot.pending is None and started == []


def test_a_live_slider_previews_moves_sets_on_release_and_follows_the_parameter():
    import param

    from apps._preview_slot import live_slider

    class Page(param.Parameterized):
        alpha = param.Number(default=0.0, bounds=(-4.0, 4.0), step=0.5, label="Strength")

    page, previews = Page(), []
    slider = live_slider(page, "alpha", previews.append)
    assert (slider.start, slider.end, slider.step, slider.name) == (-4.0, 4.0, 0.5, "Strength")
    slider.value = 1.5                                  # a move
    assert previews == [1.5] and page.alpha == 0.0
    with param.edit_constant(slider):                   # the release (the browser sets it)
        slider.value_throttled = 2.0
    assert page.alpha == 2.0
    page.alpha = -3.0                                   # set elsewhere (a link)
    assert slider.value == -3.0 and previews == [1.5]   # moved without a preview
