"""Credentials inside the path (`--scheme path`), end to end, against a fake bot API.

The recording upstream of tests/e2e/upstream.py plays Telegram's bot API on api.test: it
answers with the path it received, so every answer is also an echo of the secret.
"""

from __future__ import annotations

import json
import secrets

import pytest

from store.crypto import Secret
from tests.e2e.conftest import Proxy
from tests.e2e.upstream import Upstream

pytestmark = pytest.mark.e2e

TOKEN = "123456:" + secrets.token_urlsafe(24)
PLACEHOLDER = "CREDPROXY_TELEGRAM"


@pytest.fixture
def bot(proxy: Proxy, names) -> tuple[str, str]:
    agent, cred = names("bot"), names("tg")
    token = proxy.store.add_principal(agent)
    proxy.store.add_credential(
        cred,
        "path",
        ["api.test"],
        Secret(TOKEN.encode()),
        options={"placeholder": PLACEHOLDER, "position": ["/bot{}", "/file/bot{}"]},
    )
    paths = [f"/bot{PLACEHOLDER}/sendMessage", f"/file/bot{PLACEHOLDER}/", "/*/getMe"]
    proxy.store.add_grant(agent, ["GET", "POST"], credential=cred, paths=paths)
    proxy.wait_reload()
    return agent, token


@pytest.mark.parametrize(
    ("path", "sent"),
    [
        pytest.param(
            f"/bot{PLACEHOLDER}/sendMessage", f"/bot{TOKEN}/sendMessage", id="a bot method"
        ),
        pytest.param(
            f"/file/bot{PLACEHOLDER}/photos/a.jpg",
            f"/file/bot{TOKEN}/photos/a.jpg",
            id="a file download, the second declared position",
        ),
    ],
)
def test_the_placeholder_is_replaced_only_as_the_request_leaves(
    proxy: Proxy, upstream: Upstream, bot: tuple[str, str], path: str, sent: str
):
    with proxy.client(*bot) as client:
        answer = client.post(f"https://api.test{path}?chat_id=1", json={"text": "hi"})
    assert answer.status_code == 200
    (received,) = upstream.log.requests
    assert received.target == sent + "?chat_id=1"
    # The upstream echoes the path it got: the agent sees it redacted.
    assert TOKEN not in answer.text and "[REDACTED]" in answer.text
    line = proxy.requests(bot[0])[-1]
    assert (line["decision"], line["path"]) == ("allow", path)
    assert TOKEN not in proxy.output()


@pytest.mark.parametrize(
    ("target", "headers", "reason"),
    [
        pytest.param(f"/bot{TOKEN}/getMe", {}, "bad-request", id="the real secret in its position"),
        pytest.param(
            f"/bot{PLACEHOLDER}/sendMessage?text={TOKEN}",
            {},
            "bad-request",
            id="the real secret in the query",
        ),
        pytest.param(
            f"/bot{PLACEHOLDER}/sendMessage",
            {"x-note": TOKEN},
            "bad-request",
            id="the real secret in a header",
        ),
        pytest.param(
            f"/bot{PLACEHOLDER}/sendMessage?text={PLACEHOLDER}",
            {},
            "bad-request",
            id="the placeholder again in the query",
        ),
        pytest.param(
            f"/bot{PLACEHOLDER}/sendMessage?text=%43redproxy_telegram",
            {},
            "bad-request",
            id="the placeholder again, encoded and in another case",
        ),
        pytest.param(
            f"/x{PLACEHOLDER}/getMe", {}, "bad-request", id="the placeholder in another position"
        ),
        pytest.param(
            f"/bot{PLACEHOLDER}/sendMessage/{PLACEHOLDER}",
            {},
            "bad-request",
            id="the placeholder in a second segment",
        ),
        pytest.param(
            "/botCREDPROXY_OTHER/sendMessage", {}, "path-not-allowed", id="another placeholder"
        ),
    ],
)
def test_a_misplaced_placeholder_or_the_secret_itself_is_refused(
    proxy: Proxy, upstream: Upstream, bot: tuple[str, str], target: str, headers, reason: str
):
    with proxy.client(*bot) as client:
        answer = client.get(f"https://api.test{target}", headers=headers)
    assert (answer.status_code, answer.headers["x-credproxy-reason"]) == (
        403 if reason == "path-not-allowed" else 400,
        reason,
    )
    assert upstream.log.requests == []
    assert TOKEN not in answer.text
    (line,) = proxy.requests(bot[0])
    assert line["reason"] == reason and TOKEN not in json.dumps(line)
