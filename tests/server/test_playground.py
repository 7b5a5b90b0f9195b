"""The playground's page as the app serves it (server/routes/playground.py, server/playground/):
the page and its assets come from the app itself, nothing from elsewhere; ``--no-playground``
leaves it out. The page driven in a browser: tests/server/test_playground_browser.py."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from rope_plugins.rules.methods import METHODS
from rope_plugins.server.app import create_app
from rope_plugins.server.config import parse_config
from rope_plugins.server.routes.playground import PAGE


def client(*flags: str) -> TestClient:
    """The app without its lifespan (no engine): only what needs none is asked of it."""
    return TestClient(create_app(parse_config(list(flags), environ={}), "unused-model-path"))


def test_the_page_and_its_assets_are_served_by_the_app():
    app = client()
    page = app.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(assets) == ["/playground/static/playground.css", "/playground/static/playground.js"]
    types = {".css": "text/css", ".js": "javascript"}
    for asset in assets:
        answer = app.get(asset)
        assert answer.status_code == 200 and types[asset[asset.rindex("."):]] in answer.headers["content-type"]


def test_nothing_is_loaded_from_elsewhere():
    """No CDN, no font or script host: every file of the page names no other origin."""
    for path in PAGE.iterdir():
        text = path.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), path.name
        assert "import(" not in text and "@import" not in text, path.name


def test_setup_offers_auto_first_then_every_method_with_its_fields():
    setup = client("--method", "leaky_rerope").get("/playground/setup.json").json()
    assert list(setup["methods"]) == ["auto", *METHODS]
    assert setup["methods"]["self_extend"] == ["window", "group"] and setup["methods"]["auto"] == []
    assert setup["default_method"] == "leaky_rerope"


@pytest.mark.parametrize("path", ["/", "/playground/setup.json", "/playground/static/playground.js"])
def test_no_playground_serves_the_api_alone(path):
    assert client("--no-playground").get(path).status_code == 404
