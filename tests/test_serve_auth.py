"""Sign-in for a shared server: `explorer serve` off loopback requires one.

The flags are parsed by `explorer.commands._common.server_sign_in` (unit tests below, one per
rule); the served gallery is then probed over HTTP on 127.0.0.1 (a server bound to 0.0.0.0 also
answers there) and, in the browser test, signed in through its own login page.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest

from explorer._checks import InputError
from explorer.benches.child import answers
from explorer.commands._common import add_serve_options, is_loopback, server_sign_in
from tests._browser import ROOT, free_port
from tests.test_serve_binding import serving


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_options(parser, port=5006)
    return parser.parse_args(list(argv))


# -- the flags ---------------------------------------------------------------------------------

@pytest.mark.parametrize("address,expected", [("127.0.0.1", True), ("127.3.2.1", True),
                                              ("localhost", True), ("::1", True),
                                              ("0.0.0.0", False), ("::", False),
                                              ("192.168.1.7", False), ("lab.example.org", False)])
def test_is_loopback(address, expected):
    assert is_loopback(address) is expected


def test_loopback_needs_no_sign_in():
    assert server_sign_in(_args(), env={}) == ({}, "no sign-in (this machine only)")


def test_off_loopback_without_a_sign_in_is_refused():
    with pytest.raises(InputError, match=r"`--address 0.0.0.0` can be reached from other "
                                         r"machines.*--password-file.*--oauth-provider.*--no-auth"):
        server_sign_in(_args("--address", "0.0.0.0"), env={})


def test_no_auth_must_be_spelled_out_and_says_so():
    kwargs, said = server_sign_in(_args("--address", "0.0.0.0", "--no-auth"), env={})
    assert kwargs == {} and said.startswith("NO SIGN-IN")


def test_password_from_the_environment_never_appears_in_the_description():
    kwargs, said = server_sign_in(_args("--address", "0.0.0.0"),
                                  env={"EXPLORER_PASSWORD": "hunter2", "EXPLORER_COOKIE_SECRET": "c" * 40})
    assert kwargs == {"basic_auth": "hunter2", "cookie_secret": "c" * 40}
    assert "hunter2" not in said and "EXPLORER_PASSWORD" in said


def test_password_file_one_line_and_json(tmp_path):
    plain = tmp_path / "pw"
    plain.write_text("open sesame\n")
    kwargs, said = server_sign_in(_args("--address", "0.0.0.0", "--password-file", str(plain)), env={})
    assert kwargs["basic_auth"] == "open sesame" and "sesame" not in said
    assert len(kwargs["cookie_secret"]) >= 32           # made up when none is given
    other, _ = server_sign_in(_args("--address", "0.0.0.0", "--password-file", str(plain)), env={})
    assert other["cookie_secret"] != kwargs["cookie_secret"]
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"ada": "a1", "alan": "t2"}))
    kwargs, said = server_sign_in(_args("--address", "0.0.0.0", "--password-file", str(users)), env={})
    assert kwargs["basic_auth"] == str(users.resolve()) and "2 users" in said


@pytest.mark.parametrize("content,match", [("", "is empty"), ("{not json", "is not valid JSON"),
                                           ('{"ada": ""}', "must map user names"),
                                           ("[1, 2]", None)])
def test_bad_password_files(tmp_path, content, match):
    path = tmp_path / "pw"
    path.write_text(content)
    if match is None:                   # a line that is not JSON is a password, even "[1, 2]"
        assert server_sign_in(_args("--password-file", str(path)), env={})[0]["basic_auth"] == "[1, 2]"
        return
    with pytest.raises(InputError, match=match):
        server_sign_in(_args("--password-file", str(path)), env={})
    with pytest.raises(InputError, match="must be a readable file"):
        server_sign_in(_args("--password-file", str(tmp_path / "missing")), env={})


def test_two_sign_ins_are_refused(tmp_path):
    path = tmp_path / "pw"
    path.write_text("x")
    with pytest.raises(InputError, match="choose one sign-in; got --password-file and EXPLORER_PASSWORD"):
        server_sign_in(_args("--password-file", str(path)), env={"EXPLORER_PASSWORD": "y"})
    with pytest.raises(InputError, match="choose one sign-in"):
        server_sign_in(_args("--oauth-provider", "github", "--no-auth"), env={})


def test_oauth_provider_is_checked_and_its_secrets_come_from_the_environment():
    with pytest.raises(InputError, match=r"must be one of .*github.*got 'githb'. Did you mean 'github'\?"):
        server_sign_in(_args("--address", "0.0.0.0", "--oauth-provider", "githb"), env={})
    with pytest.raises(InputError, match="needs PANEL_OAUTH_KEY and PANEL_OAUTH_SECRET"):
        server_sign_in(_args("--address", "0.0.0.0", "--oauth-provider", "github"), env={})
    kwargs, said = server_sign_in(_args("--address", "0.0.0.0", "--oauth-provider", "github"),
                                  env={"PANEL_OAUTH_KEY": "k", "PANEL_OAUTH_SECRET": "s",
                                       "PANEL_COOKIE_SECRET": "z" * 40})
    assert kwargs == {"cookie_secret": "z" * 40, "oauth_provider": "github", "oauth_key": "k",
                      "oauth_secret": "s"}
    assert said == "sign-in: OAuth (github)"


def test_the_provider_list_is_panels():
    from panel.auth import AUTH_PROVIDERS as PANELS

    from explorer.commands._common import AUTH_PROVIDERS
    assert set(AUTH_PROVIDERS) == set(PANELS)


def test_the_password_is_not_a_command_line_flag():
    with pytest.raises(SystemExit):
        with contextlib.redirect_stderr(None):
            _args("--password", "x")


def test_one_template_draws_the_sign_in_form_and_the_signed_out_page():
    """Panel renders the login page with ``login_endpoint``/``errormessage`` and the logout
    page with ``LOGIN_ENDPOINT``; the one template answers each with its own page."""
    from panel.auth import BasicAuthProvider

    from apps._server import with_sign_in_pages

    kwargs = with_sign_in_pages({"basic_auth": "secret"})
    provider = BasicAuthProvider(login_template=kwargs["basic_login_template"],
                                 logout_template=kwargs["logout_template"])
    login = provider._login_template.render(login_endpoint="/login", errormessage="Wrong!",
                                            PANEL_CDN="https://cdn.example")
    assert "<title>Sign in: explorer</title>" in login
    assert 'action="./login"' in login and 'name="password"' in login
    assert '<div class="error" role="alert">Wrong!</div>' in login
    assert "Signed out" not in login and "cdn.example" not in login
    logout = provider._logout_template.render(LOGIN_ENDPOINT="/login",
                                              PANEL_CDN="https://cdn.example")
    assert "<title>Signed out: explorer</title>" in logout
    assert '<a href="./login">Sign in again</a>' in logout
    assert "<form" not in logout and "cdn.example" not in logout


# -- the served gallery ----------------------------------------------------------------------

class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _get(url: str, cookie: str = "") -> tuple[int, dict[str, str], bytes]:
    opener = urllib.request.build_opener(_NoRedirect)
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with opener.open(request, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _login(port: int, user: str, password: str) -> tuple[int, dict[str, str], str]:
    opener = urllib.request.build_opener(_NoRedirect)
    data = urllib.parse.urlencode({"username": user, "password": password}).encode()
    try:
        with opener.open(f"http://127.0.0.1:{port}/login", data=data, timeout=60) as r:
            headers = r.headers
            status = r.status
    except urllib.error.HTTPError as e:
        headers, status = e.headers, e.code
    cookies = "; ".join(c.split(";")[0] for c in headers.get_all("Set-Cookie") or [])
    return status, dict(headers), cookies


@pytest.mark.slow
def test_serve_off_loopback_without_sign_in_exits_before_listening(tmp_path):
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "explorer.cli", "serve", "--model", "tiny-llama",
                           "--port", str(port), "--address", "0.0.0.0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in __import__("os").environ.items()
                               if k != "EXPLORER_PASSWORD"})
    assert done.returncode == 2
    assert "needs a sign-in" in done.stderr and "--no-auth" in done.stderr
    assert not answers(port)


@pytest.mark.slow
def test_a_password_server_sends_strangers_to_its_login_page(tmp_path):
    secret = "correct horse battery"
    with serving(tmp_path, "--address", "0.0.0.0",
                  env={"EXPLORER_PASSWORD": secret}) as (proc, port):
        status, headers, _ = _get(f"http://127.0.0.1:{port}/")
        assert status == 302 and "/login" in headers["Location"]
        status, _, body = _get(f"http://127.0.0.1:{port}/login")
        page = body.decode()
        assert status == 200 and 'name="password"' in page and "cdn" not in page.lower()
        for guess in ("/explorer-lens.zip", "/static/explorer-lens.zip", "/ws", "/files/x.nc"):
            status, _, body = _get(f"http://127.0.0.1:{port}{guess}")
            assert status in (302, 401, 403, 404), (guess, status)
            assert b"bokeh" not in body.lower()
        status, headers, cookies = _login(port, "someone", "wrong")
        assert status == 302 and "error=" in headers["Location"] and "user=" not in cookies
        status, headers, cookies = _login(port, "someone", secret)
        assert status == 302 and "user=" in cookies
        status, _, body = _get(f"http://127.0.0.1:{port}/", cookie=cookies)
        assert status == 200 and b"bokeh" in body.lower()
    err = next(tmp_path.glob("serve-*.err")).read_text()
    assert "sign-in: password (from EXPLORER_PASSWORD)" in err and secret not in err


@pytest.mark.slow
def test_no_auth_serves_with_a_warning(tmp_path):
    with serving(tmp_path, "--address", "0.0.0.0", "--no-auth") as (proc, port):
        status, _, body = _get(f"http://127.0.0.1:{port}/")
        assert status == 200 and b"bokeh" in body.lower()
    err = next(tmp_path.glob("serve-*.err")).read_text()
    assert "warning: --no-auth on 0.0.0.0: anyone who can reach the port" in err


@pytest.mark.browser
@pytest.mark.slow
def test_browser_signs_in_through_the_login_page(tmp_path, browser):
    secret = "s3cret-for-the-test"
    with serving(tmp_path, "--address", "0.0.0.0", env={"EXPLORER_PASSWORD": secret}) as (proc, port):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"http://127.0.0.1:{port}/", timeout=120_000)
        page.wait_for_selector("input[name=password]", timeout=60_000)
        assert "/login" in page.url
        page.fill("input[name=username]", "ada")
        page.fill("input[name=password]", "not it")
        page.click("#signin")
        page.wait_for_selector("text=Invalid username or password", timeout=30_000)
        assert "/login" in page.url
        page.fill("input[name=username]", "ada")
        page.fill("input[name=password]", secret)
        page.click("#signin")
        page.wait_for_function("() => window.Bokeh && Bokeh.documents && Bokeh.documents.length > 0",
                               timeout=180_000)
        assert "/login" not in page.url
        page.close()
